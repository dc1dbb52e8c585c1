"""Tool-call parsing in every family format: the calls a reply was built from come back (names,
arguments equal as JSON, ids in the family's style), the text around them is the content, and
the streamed deltas concatenated are the same for every split of the reply into pieces."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flotilla.services.tokenizer.tool_calls import Parsed, ToolCallParser
from flotilla.services.tokenizer.tool_formats import (
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolFormat,
    detect,
)

NAMES = ["get_weather", "search", "a.b-c_1"]
# Formats that read calls anywhere in the reply; the others only at its start.
ANYWHERE = {"hermes", "mistral", "mistral_list", "llama_function"}
TRICKY = ["{", "}", "[", "]", '"', "\\", "</tool_call>", "[ARGS]", "[TOOL_CALLS]", "</function>",
          "<tool_call>", ";", "é", "日本", "🙂", "\n", "\t", "\\u00e9"]

json_text = st.lists(st.sampled_from(TRICKY) | st.characters(codec="utf-8"),
                     max_size=6).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | json_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(json_text, inner, max_size=3),
    max_leaves=8)
arguments = st.dictionaries(json_text, json_values, max_size=4)
calls = st.lists(st.tuples(st.sampled_from(NAMES), arguments), min_size=1, max_size=3)
content = st.text(st.characters(codec="utf-8", exclude_characters="<[{\\\"") | st.just(" "),
                  max_size=15)


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def run(text_pieces: list[str], fmt: ToolFormat = HERMES, parallel: bool = True,
        names: list[str] = NAMES) -> tuple[str, list[dict[str, Any]]]:
    """Content and calls (id, name, arguments text) accumulated the way the gateway does.
    Ids are random: `same` compares results without them."""
    parser = ToolCallParser(names, parallel=parallel, new_id=fmt.new_call_id)
    results: list[Parsed] = [parser.push(p) for p in text_pieces] + [parser.flush()]
    out: dict[int, dict[str, Any]] = {}
    for r in results:
        for d in r.calls:
            if d.index not in out:  # a call's first delta names it
                assert d.id and d.name, d
                assert d.index == len(out), "calls are numbered in order"
                out[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            else:
                assert d.id is None and d.name is None, "id and name come first, once"
            out[d.index]["arguments"] += d.arguments
    return "".join(r.content for r in results), [out[i] for i in sorted(out)]


def same(a: tuple[str, list[dict[str, Any]]], b: tuple[str, list[dict[str, Any]]]) -> bool:
    def strip(r: tuple[str, list[dict[str, Any]]]) -> tuple[str, list[tuple[str, str]]]:
        return r[0], [(c["name"], c["arguments"]) for c in r[1]]
    return strip(a) == strip(b)


def render(fmt: ToolFormat, made: list[tuple[str, dict[str, Any]]], ascii_only: bool) -> str:
    return fmt.calls_text([(n, json.dumps(a, ensure_ascii=ascii_only)) for n, a in made])


@settings(max_examples=150, deadline=None)
@given(fmt_name=st.sampled_from(sorted(FORMATS)), made=calls, before=content, after=content,
       ascii_only=st.booleans(), cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_streamed_equals_whole_and_recovers_the_calls(fmt_name: str, made: list, before: str,
                                                      after: str, ascii_only: bool,
                                                      cuts: list[int]) -> None:
    fmt = FORMATS[fmt_name]
    if fmt_name not in ANYWHERE:
        before = " \n" if before.strip() else before  # these formats open the reply
    # text that begins with the separator between calls ("; " for llama3_json) reads as one
    sep = fmt.separator.strip()
    assume(not (sep and after.lstrip().startswith(sep)))
    text = before + render(fmt, made, ascii_only) + after
    whole = run([text], fmt)
    assert same(run(pieces(text, cuts), fmt), whole)
    assert same(run(list(text), fmt), whole)  # one character at a time
    got_content, got_calls = whole
    expected = (before if before.strip() else "") + (after if after.strip() else "")
    assert got_content == expected
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == made
    style = r"[A-Za-z0-9]{9}" if fmt.id_style == "mistral" else r"call_[0-9a-f]{24}"
    assert all(re.fullmatch(style, c["id"]) for c in got_calls)


FRAGMENTS = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ": ", '"get_weather"', ", ",
             '"arguments"', '"parameters"', "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "get_weather",
             "<function=", ">", "</function>", "<|python_tag|>", "[", "]", " ", "\n", "x", "\\",
             '"', ";", "1", "null", "<tool_", "[TOOL"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
       cuts=st.lists(st.integers(0, 10**4), max_size=10), parallel=st.booleans())
def test_any_text_parses_the_same_however_split(parts: list[str], cuts: list[int],
                                                parallel: bool) -> None:
    text = "".join(parts)
    whole = run([text], parallel=parallel)
    assert same(run(pieces(text, cuts), parallel=parallel), whole)
    assert len(whole[1]) <= (1 if not parallel else len(whole[1]))


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("reply,content,made", [
    ("I'll check. " + HERMES_CALL, "I'll check. ", [("get_weather", {"city": "Paris"})]),
    (HERMES_CALL.removesuffix("</tool_call>"), "", [("get_weather", {"city": "Paris"})]),
    (HERMES_CALL.replace("get_weather", "rm_rf"), HERMES_CALL.replace("get_weather", "rm_rf"), []),
    ("<tool_call>{not json}</tool_call> ok", "<tool_call>{not json}</tool_call> ok", []),
    ("a <tool_cal b", "a <tool_cal b", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call is content
    ("[1, 2] and more", "[1, 2] and more", []),
    ('<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call>', "",
     [("search", {"q": 1})]),  # arguments before the name
    ('<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>', "",
     [("search", {"q": "x"})]),  # arguments as a JSON string
    ('<|python_tag|>{"name": "search", "parameters": {"q": "llama"}}', "",
     [("search", {"q": "llama"})]),
    ('[TOOL_CALLS]search[CALL_ID]abcDEF123[ARGS]{"q": "x"}', "", [("search", {"q": "x"})]),
    ('[TOOL_CALLS]nope[ARGS]{}', "[TOOL_CALLS]nope[ARGS]{}", []),
    ('See <function=search>{"q": "x"}</function>\nDone.', "See \nDone.", [("search", {"q": "x"})]),
])
def test_examples(reply: str, content: str, made: list) -> None:
    for split in ([reply], list(reply)):
        got_content, got_calls = run(split)
        assert got_content == content
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == made


def test_mistral_call_id_is_kept() -> None:
    _, got = run(['[TOOL_CALLS]search[CALL_ID]abcDEF123[ARGS]{"q": "x"}'], MISTRAL)
    assert got[0]["id"] == "abcDEF123"


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    reply = HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo")
    _, got = run([reply], parallel=False)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == [
        ("get_weather", {"city": "Paris"})]


def test_arguments_stream_as_they_arrive() -> None:
    """Name and id in the first delta, then fragments while the model is still writing."""
    parser = ToolCallParser(NAMES)
    first = parser.push('<tool_call>\n{"name": "search", "arguments": {"q": "hel')
    assert [(d.index, d.name, d.arguments) for d in first.calls] == [(0, "search", '{"q": "hel')]
    second = parser.push('lo"}}\n</tool_call>')
    assert [(d.index, d.id, d.name, d.arguments) for d in second.calls] == [
        (0, None, None, 'lo"}')]


@pytest.mark.parametrize("template,reads_tools,expected", [
    ("{{ messages }}", False, "hermes"),
    ("{% if tools %}<tool_call>{% endif %}", True, "hermes"),
    ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]{{ name }}[ARGS]", True, "mistral"),
    ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", True, "mistral_list"),
    ("<|start_header_id|>{{ tools }}", True, "llama3_json"),
    ("<function={{ tools }}", True, "llama_function"),
    ("{{ tools }}", True, "json"),
])
def test_family_detection(template: str, reads_tools: bool, expected: str) -> None:
    assert detect(template, reads_tools).name == expected
    assert LLAMA3_JSON.calls_text([("f", "{}"), ("g", "{}")]) == \
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_two_calls_in_one_chunk(fmt_name: str) -> None:
    fmt = FORMATS[fmt_name]
    made = [("search", {"q": "a {b} \"c\" \\ é"}), ("get_weather", {"city": "Zürich"})]
    text = render(fmt, made, ascii_only=False)
    one_by_one = run(list(text), fmt)
    for split in ([text], [text[:3], text[3:]]):
        got = run(split, fmt)
        assert same(got, one_by_one)
        assert [(c["name"], json.loads(c["arguments"])) for c in got[1]] == made
