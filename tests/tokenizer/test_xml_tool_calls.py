"""Tool calls of GLM-4.5+ (`<arg_key>` / `<arg_value>`), Qwen3-Coder / Qwen3.5
(`<function=...><parameter=...>`), MiniMax-M2 (`<minimax:tool_call><invoke name=...>`) and
DeepSeek-V3.2 (DSML `<｜DSML｜invoke name=...>`): a turn with tool calls rendered by the
model's real chat template (llama.cpp's collection, rendered by transformers) parses back to the
same calls, and the streamed deltas concatenated are the same for every split of the reply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.services.tokenizer.tool_formats import (
    DSML,
    GLM,
    MINIMAX,
    QWEN_XML,
    XML_FORMATS,
    ToolFormat,
    detect,
)
from flotilla.services.tokenizer.xml_tool_calls import SYNTAXES, XmlToolCallParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": ["string", "null"]},
                                         "tags": {"type": "array"}}}}},
]
NAMES = ["get_weather", "search"]


def run(fmt: ToolFormat, pieces: list[str], parallel: bool = True
        ) -> tuple[str, list[tuple[str, str]]]:
    parser = XmlToolCallParser(SYNTAXES[fmt.name], TOOLS, parallel=parallel)
    got = [parser.push(p) for p in pieces] + [parser.flush()]
    calls: list[list[str]] = []
    for g in got:
        for d in g.calls:
            if d.name is not None:
                assert d.id and d.index == len(calls)
                calls.append([d.name, ""])
            calls[d.index][1] += d.arguments
    return "".join(g.content for g in got), [(n, a) for n, a in calls]


TRICKY = ["{", "}", "<", ">", '"', "\\", "é", "日本", "🙂", "\n", " ", "null", "1", "[1]",
          "<arg", "</tool", "<param", "</invoke", "<｜DSML｜", "x"]
strings = st.lists(st.sampled_from(TRICKY) | st.characters(codec="utf-8", exclude_categories=[
    "Cs"]), max_size=6).map("".join).filter(lambda s: "</arg_value>" not in s
                                           and "</parameter>" not in s
                                           and "</｜DSML｜parameter>" not in s)
weather = st.fixed_dictionaries({}, optional={
    "city": strings, "days": st.integers(-10, 10**6),
    "opts": st.dictionaries(strings, st.integers() | strings | st.none(), max_size=2)})
search = st.fixed_dictionaries({}, optional={
    "q": strings, "tags": st.lists(strings | st.integers(), max_size=3)})
calls = st.lists(st.one_of(st.tuples(st.just("get_weather"), weather),
                           st.tuples(st.just("search"), search)), min_size=1, max_size=3)
content = st.text(st.characters(codec="utf-8", exclude_characters="<") | st.just(" "),
                  max_size=12)


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=150, deadline=None)
@given(fmt_name=st.sampled_from(sorted(XML_FORMATS)), made=calls, before=content,
       after=content, cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_streamed_equals_whole_and_recovers_the_calls(fmt_name: str, made: list, before: str,
                                                      after: str, cuts: list[int]) -> None:
    fmt = XML_FORMATS[fmt_name]
    text = before + fmt.calls_text([(n, json.dumps(a)) for n, a in made]) + after
    whole = run(fmt, [text])
    assert run(fmt, pieces(text, cuts)) == whole
    assert run(fmt, list(text)) == whole
    got_content, got_calls = whole
    assert got_content == (before if before.strip() else "") + (after if after.strip() else "")
    assert [(n, json.loads(a)) for n, a in got_calls] == made


FRAGMENTS = ["<tool_call>", "</tool_call>", "get_weather", "search", "nope", "<arg_key>",
             "</arg_key>", "<arg_value>", "</arg_value>", "<function=", "</function>",
             "<parameter=", "</parameter>", ">", "city", "\n", " ", "x", "1", "<", "{",
             "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="', '">', "</invoke>",
             '<parameter name="', "<｜DSML｜function_calls>", "</｜DSML｜function_calls>",
             '<｜DSML｜invoke name="', "</｜DSML｜invoke>", '<｜DSML｜parameter name="',
             '" string="true">', '" string="false">', "</｜DSML｜parameter>"]


@settings(max_examples=300, deadline=None)
@given(fmt_name=st.sampled_from(sorted(XML_FORMATS)),
       parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
       cuts=st.lists(st.integers(0, 10**4), max_size=10), parallel=st.booleans())
def test_any_text_parses_the_same_however_split(fmt_name: str, parts: list[str],
                                                cuts: list[int], parallel: bool) -> None:
    fmt = XML_FORMATS[fmt_name]
    text = "".join(parts)
    whole = run(fmt, [text], parallel)
    assert run(fmt, pieces(text, cuts), parallel) == whole
    assert all(json.loads(a) is not None for _, a in whole[1])  # arguments are JSON
    assert parallel or len(whole[1]) <= 1


@pytest.mark.parametrize("fmt,reply,content,made", [
    (GLM, "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
          "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
     "Sure.\n", [("get_weather", {"city": "Paris", "days": 3})]),
    (GLM, "<tool_call>rm_rf\n<arg_key>x</arg_key></tool_call>",
     "<tool_call>rm_rf\n<arg_key>x</arg_key></tool_call>", []),
    (GLM, "<tool_call>search</tool_call>", "", [("search", {})]),
    # a string-typed parameter keeps JSON-looking text as a string; others parse it
    (QWEN_XML, "<tool_call>\n<function=search>\n<parameter=q>\n[1, 2]\n</parameter>\n"
               "<parameter=tags>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
     "", [("search", {"q": "[1, 2]", "tags": [1, 2]})]),
    # cut short inside a value: the complete parameters stay
    (QWEN_XML, "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
               "<parameter=city>\nPar", "", [("get_weather", {"days": 2})]),
    (QWEN_XML, "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
               "oops", "oops", [("get_weather", {"city": "A"})]),
    # a block holds several calls; text in it that starts no call ends it (and is content)
    (MINIMAX, '<minimax:tool_call>\n<invoke name="search">\n<parameter name="q">a</parameter>'
              '\n</invoke>\n<invoke name="get_weather">\n</invoke>\n</minimax:tool_call> ok',
     " ok", [("search", {"q": "a"}), ("get_weather", {})]),
    (MINIMAX, '<minimax:tool_call>\n<invoke name="search">\n</invoke>\nbye', "bye",
     [("search", {})]),
    (MINIMAX, '<minimax:tool_call>\n<invoke name="nope">\n</invoke>\n</minimax:tool_call>',
     '<minimax:tool_call>\n<invoke name="nope">\n</invoke>\n</minimax:tool_call>', []),
    # DSML's `string` attribute decides over the schema
    (DSML, '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" '
           'string="false">null</｜DSML｜parameter>\n<｜DSML｜parameter name="tags" string="true">'
           '[1]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>', "",
     [("search", {"q": None, "tags": "[1]"})]),
])
def test_examples(fmt: ToolFormat, reply: str, content: str, made: list) -> None:
    for split in ([reply], list(reply)):
        got_content, got_calls = run(fmt, split)
        assert got_content == content
        assert [(n, json.loads(a)) for n, a in got_calls] == made


# ------------------------------------------------------------------ real templates

CALLS = [("get_weather", {"city": "Paris", "days": 2, "opts": {"unit": "c"}}),
         ("search", {"q": "42", "tags": ["a", 1]})]


# template, its format, the assistant turn's opening, the ends of turns after it
REAL = [("GLM-4.6", GLM, "<|assistant|>", "<|user|>"),
        ("GLM-4.7-Flash", GLM, "<|assistant|>", "<|user|>"),
        ("Qwen3-Coder", QWEN_XML, "<|im_start|>assistant\n", "<|im_end|>"),
        ("Qwen3.5-4B", QWEN_XML, "<|im_start|>assistant\n", "<|im_end|>"),
        ("MiniMax-M2", MINIMAX, "]~b]ai\n", "[e~["),
        ("deepseek-ai-DeepSeek-V3.2", DSML, "<｜Assistant｜></think>", "<｜end▁of▁sentence｜>")]


@pytest.mark.parametrize("template,fmt,opening,end", REAL, ids=[r[0] for r in REAL])
def test_real_template_turns_parse_back(llama_cpp_templates: Path, template: str,
                                        fmt: ToolFormat, opening: str, end: str) -> None:
    """The template writes an assistant turn with two calls; the reply part of it (between
    the assistant's opening and the end of turn) parses back to those calls."""
    from flotilla.services.tokenizer.chat_template import ChatTemplate
    transformers = pytest.importorskip("transformers")
    del transformers
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (llama_cpp_templates / f"{template}.jinja").read_text(encoding="utf-8")
    assert detect(source, ChatTemplate(source).uses_tools) is fmt
    user = [{"role": "user", "content": "Weather?"}]
    turn = {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS]}

    def render(messages: list[dict[str, Any]], prompt: bool) -> str:
        out, _ = render_jinja_template([messages], chat_template=source, tools=TOOLS,
                                       add_generation_prompt=prompt)
        return str(out[0])

    full = render([*user, turn, {"role": "user", "content": "thanks"}], False)
    reply = full[full.rindex(opening) + len(opening):]
    reply = reply[:reply.index(end)]
    if fmt.opening:  # the block formats: written as the template writes them
        assert fmt.calls_text([(n, json.dumps(a)) for n, a in CALLS]) in reply
    for split in ([reply], list(reply)):
        content, got = run(fmt, split)
        assert [(n, json.loads(a)) for n, a in got] == CALLS
        assert "Let me check." in content
        assert "<tool_call>" not in content and "invoke" not in content


@pytest.mark.parametrize("fmt_name", sorted(XML_FORMATS))
def test_forced_calls_are_calls_the_parser_reads(fmt_name: str) -> None:
    """tool_choice "required" / a named function: the grammar takes the calls as the family
    writes them (and nothing before them); the parser reads them back."""
    from xgrammar.testing import _is_grammar_accept_string

    from flotilla.services.tokenizer.guided import grammar_of, tool_call_spec

    fmt = XML_FORMATS[fmt_name]
    text = fmt.calls_text([(n, json.dumps(a)) for n, a in CALLS])
    required = grammar_of(tool_call_spec(TOOLS, "required", True, fmt))
    assert _is_grammar_accept_string(required, text)
    assert not _is_grammar_accept_string(required, "Sure. " + text)
    assert [(n, json.loads(a)) for n, a in run(fmt, [text])[1]] == CALLS
    named = grammar_of(tool_call_spec(TOOLS, {"type": "function", "function": {
        "name": "search"}}, True, fmt))
    one = fmt.calls_text([(n, json.dumps(a)) for n, a in CALLS[1:]])
    assert _is_grammar_accept_string(named, one)
    assert not _is_grammar_accept_string(named, text)
