"""Gemma 4's tool calls (`<|tool_call>call:NAME{k:v}<tool_call|>`): a turn with tool calls
rendered by Gemma 4's real chat template (llama.cpp's collection, rendered by transformers)
parses back to the same calls, and the streamed deltas concatenated are the same for every
split of the reply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.services.tokenizer.chat_template import ChatTemplate
from flotilla.services.tokenizer.gemma4_tool_calls import Gemma4ToolCallParser
from flotilla.services.tokenizer.tool_formats import GEMMA4, detect

NAMES = ["get_weather", "search"]


def run(pieces: list[str], parallel: bool = True) -> tuple[str, list[tuple[str, str]]]:
    parser = Gemma4ToolCallParser(NAMES, parallel=parallel)
    got = [parser.push(p) for p in pieces] + [parser.flush()]
    calls: list[list[str]] = []
    for g in got:
        for d in g.calls:
            if d.name is not None:
                assert d.id and d.index == len(calls)
                calls.append([d.name, ""])
            calls[d.index][1] += d.arguments
    return "".join(g.content for g in got), [(n, a) for n, a in calls]


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


keys = st.text("abcxyz_", min_size=1, max_size=4)
strings = st.lists(st.sampled_from(["{", "}", ",", ":", "[", "]", '"', "é", "🙂", "\n", " ",
                                    "<tool_call|>", "}<tool_call|>", "x", "None", "1"]),
                   max_size=5).map("".join)
values = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | strings,
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(keys, inner, max_size=3), max_leaves=6)
calls = st.lists(st.tuples(st.sampled_from(NAMES), st.dictionaries(keys, values, max_size=3)),
                 min_size=1, max_size=3)
content = st.text(st.characters(codec="utf-8", exclude_characters="<") | st.just(" "),
                  max_size=12)


@settings(max_examples=150, deadline=None)
@given(made=calls, before=content, after=content,
       cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_streamed_equals_whole_and_recovers_the_calls(made: list, before: str, after: str,
                                                      cuts: list[int]) -> None:
    text = before + GEMMA4.calls_text([(n, json.dumps(a)) for n, a in made]) + after
    whole = run([text])
    assert run(pieces(text, cuts)) == whole
    assert run(list(text)) == whole
    assert whole[0] == (before if before.strip() else "") + (after if after.strip() else "")
    assert [(n, json.loads(a)) for n, a in whole[1]] == made


FRAGMENTS = ["<|tool_call>", "<tool_call|>", "call:", "get_weather", "nope", "{", "}", "[",
             "]", ",", ":", '<|"|>', "x", "1", "true", " ", "\n", "<|tool"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
       cuts=st.lists(st.integers(0, 10**4), max_size=10), parallel=st.booleans())
def test_any_text_parses_the_same_however_split(parts: list[str], cuts: list[int],
                                                parallel: bool) -> None:
    text = "".join(parts)
    whole = run([text], parallel)
    assert run(pieces(text, cuts), parallel) == whole
    assert all(isinstance(json.loads(a), dict) for _, a in whole[1])
    assert parallel or len(whole[1]) <= 1


@pytest.mark.parametrize("reply,content,made", [
    ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>', "",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("<|tool_call>call:rm_rf{}<tool_call|>", "<|tool_call>call:rm_rf{}<tool_call|>", []),
    ('Checking. <|tool_call>call:search{q:<|"|>a}b<|"|>}<tool_call|>', "Checking. ",
     [("search", {"q": "a}b"})]),
    ('<|tool_call>call:search{q:<|"|>cut', "", [("search", {})]),  # cut short
])
def test_examples(reply: str, content: str, made: list) -> None:
    for split in ([reply], list(reply)):
        got_content, got = run(split)
        assert got_content == content
        assert [(n, json.loads(a)) for n, a in got] == made


def test_real_template_turn_parses_back(llama_cpp_templates: Path) -> None:
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (llama_cpp_templates / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
    assert detect(source, ChatTemplate(source).uses_tools) is GEMMA4
    made = [("get_weather", {"city": "Zürich", "opts": {"unit": "c", "days": [1, 2]},
                             "exact": True, "note": None}),
            ("search", {"q": "a, b: {c}"})]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in NAMES]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": n, "arguments": a}}
                    for n, a in made]}]
    out, _ = render_jinja_template([messages], chat_template=source, tools=tools,
                                   bos_token="<bos>")
    text = str(out[0])
    reply = text[text.index("<|tool_call>"):text.rindex("<tool_call|>") + len("<tool_call|>")]
    for split in ([reply], list(reply)):
        assert [(n, json.loads(a)) for n, a in run(split)[1]] == made
