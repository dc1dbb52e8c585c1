"""Llama 4's pythonic tool calls (`[f(x=1), g(y="z")]` opening the reply): the calls come back
as Python's own parser reads the list, the text after it is content, and the deltas
concatenated are the same for every split of the reply."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.services.tokenizer.pythonic_tool_calls import PythonicToolCallParser
from flotilla.services.tokenizer.tool_formats import PYTHONIC, detect

NAMES = ["get_weather", "search"]


def run(pieces: list[str], parallel: bool = True) -> tuple[str, list[tuple[str, str]]]:
    parser = PythonicToolCallParser(NAMES, parallel=parallel)
    got = [parser.push(p) for p in pieces] + [parser.flush()]
    calls = [(d.name or "", d.arguments) for g in got for d in g.calls]
    return "".join(g.content for g in got), calls


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


keys = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True).filter(
    lambda k: k not in ("if", "in", "is", "or", "and", "not", "for", "def", "del", "as", "try"))
strings = st.lists(st.sampled_from(["(", ")", "[", "]", "'", '"', "\\", "é", "🙂", "\n", " ",
                                    "x", "{", "}", ","]), max_size=6).map("".join)
values = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | strings,
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(strings, inner, max_size=2), max_leaves=6)
calls = st.lists(st.tuples(st.sampled_from(NAMES), st.dictionaries(keys, values, max_size=3)),
                 min_size=1, max_size=3)
after = st.text(st.characters(codec="utf-8") | st.just(" "), max_size=12)


@settings(max_examples=150, deadline=None)
@given(made=calls, lead=st.sampled_from(["", " ", "\n"]), after=after,
       cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_streamed_equals_whole_and_recovers_the_calls(made: list, lead: str, after: str,
                                                      cuts: list[int]) -> None:
    text = lead + PYTHONIC.calls_text([(n, json.dumps(a)) for n, a in made]) + after
    whole = run([text])
    assert run(pieces(text, cuts)) == whole
    assert run(list(text)) == whole
    assert whole[0] == after.lstrip()
    assert [(n, json.loads(a)) for n, a in whole[1]] == made


FRAGMENTS = ["[", "]", "(", ")", "get_weather", "search", "nope", "x=", "1", "'a'", '"', "'",
             ",", " ", "\n", "\\", "{", "}", "None"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
       cuts=st.lists(st.integers(0, 10**4), max_size=10), parallel=st.booleans())
def test_any_text_parses_the_same_however_split(parts: list[str], cuts: list[int],
                                                parallel: bool) -> None:
    text = "".join(parts)
    whole = run([text], parallel)
    assert run(pieces(text, cuts), parallel) == whole
    assert parallel or len(whole[1]) <= 1
    if not whole[1]:
        assert whole[0] == text  # nothing taken, nothing lost


@pytest.mark.parametrize("reply,content,made", [
    ('[get_weather(city="Paris", days=3), search(q=\'a)b\')] Done.', "Done.",
     [("get_weather", {"city": "Paris", "days": 3}), ("search", {"q": "a)b"})]),
    ("[1, 2] is a list", "[1, 2] is a list", []),
    ("[rm_rf(path='/')]", "[rm_rf(path='/')]", []),
    ("[search(q=input())]", "[search(q=input())]", []),  # not a literal: not run, not a call
    ("Sure: [search(q='x')]", "Sure: [search(q='x')]", []),  # calls open the reply
    ("[search(q='cut", "[search(q='cut", []),
])
def test_examples(reply: str, content: str, made: list) -> None:
    for split in ([reply], list(reply)):
        got_content, got = run(split)
        assert got_content == content
        assert [(n, json.loads(a)) for n, a in got] == made


def test_detected_from_the_pythonic_prompt() -> None:
    source = ("{{ tools }} Use exact format: [func_name1(param1=value1, param2=value2), "
              "func_name2(...)]")
    assert detect(source, True) is PYTHONIC
