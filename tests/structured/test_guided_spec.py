"""Request → guided-decoding spec, checked before admission: bad or hostile schemas are 400s
naming the parameter (quickly), and the grammar of forced tool calls accepts exactly the calls
each family writes."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import TextRequest
from flotilla.services.tokenizer.guided import MAX_BOUND, guided_spec
from flotilla.services.tokenizer.tool_formats import FORMATS, HERMES

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat(**kw: Any) -> TextRequest:
    return TextRequest(request_id="r", model="m", kind="chat", stream_subject="s",
                       messages=[{"role": "user", "content": "x"}], **kw)


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def deep(n: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        node = {"type": "object", "properties": {"a": node}}
    return node


@pytest.mark.parametrize("schema,why", [
    ({"type": "no-such-type"}, "valid JSON Schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "cannot be used"),
    ({"type": "string", "maxLength": MAX_BOUND + 1}, "limit"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 10**9}, "limit"),
    (deep(40), "nested too deeply"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                       for i in range(1000)}}, "too large"),
    ({"type": "string", "pattern": "(unclosed"}, "valid JSON Schema"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "cannot be used"),
])
def test_bad_schemas_are_refused_quickly(schema: Any, why: str) -> None:
    start = time.monotonic()
    with pytest.raises(FlotillaError) as err:
        guided_spec(chat(response_format=schema_format(schema)), HERMES)
    assert time.monotonic() - start < 2.0
    info = err.value.info
    assert info.status == 400 and info.param == "response_format.json_schema.schema"
    assert why in info.message, info.message


def test_bad_tool_parameters_are_refused_only_when_forced() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    with pytest.raises(FlotillaError) as err:
        guided_spec(chat(tools=[WEATHER, bad], tool_choice="required"), HERMES)
    assert err.value.info.param == "tools[1].function.parameters"
    assert guided_spec(chat(tools=[WEATHER, bad], tool_choice="auto"), HERMES) is None


def test_which_requests_are_constrained() -> None:
    assert guided_spec(chat(), HERMES) is None
    assert guided_spec(chat(response_format={"type": "text"}), HERMES) is None
    obj = guided_spec(chat(response_format={"type": "json_object"}), HERMES)
    assert obj is not None and obj.kind == "json_object"
    forced = guided_spec(chat(tools=[WEATHER], tool_choice="required",
                              response_format={"type": "json_object"}), HERMES)
    assert forced is not None and forced.kind == "structural_tag"  # calls win
    assert guided_spec(chat(tools=[WEATHER], tool_choice="none"), HERMES) is None
    completion = TextRequest(request_id="r", model="m", kind="completion", prompt="x",
                             stream_subject="s", response_format={"type": "json_object"})
    assert guided_spec(completion, HERMES) is not None


args = st.dictionaries(st.sampled_from(["city", "q", "n"]),
                       st.text(max_size=5) | st.integers(-5, 5), max_size=3)


@settings(max_examples=40, deadline=None)
@given(fmt_name=st.sampled_from(sorted(FORMATS)), calls=st.lists(args, min_size=1, max_size=3),
       parallel=st.booleans())
def test_forced_grammar_accepts_the_family_format(fmt_name: str, calls: list[dict[str, Any]],
                                                  parallel: bool) -> None:
    from xgrammar.testing import _is_grammar_accept_string

    from flotilla.services.tokenizer.guided import grammar_of

    fmt = FORMATS[fmt_name]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    spec = guided_spec(chat(tools=[tool], tool_choice="required",
                            parallel_tool_calls=parallel), fmt)
    assert spec is not None
    text = fmt.calls_text([("f", json.dumps(a)) for a in calls])
    accepted = _is_grammar_accept_string(grammar_of(spec), text)
    assert accepted == (parallel or len(calls) == 1), text
    assert not _is_grammar_accept_string(grammar_of(spec), "Sure! " + text)
