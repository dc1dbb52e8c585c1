"""The engine's sampler under a grammar: whatever the logits say, what comes out follows the
spec. Random logits stand in for the model (the worst case: no preference for valid text);
outputs are checked with independent readers (json, jsonschema, the tool-call parser)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from flotilla.libs.common.messages import GuidedDecoding, TextRequest
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.sampler import Sampler, SamplingBatch
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.structured import StructuredOutputs
from flotilla.services.tokenizer.guided import guided_spec
from flotilla.services.tokenizer.tokenizer import Tokenizer
from flotilla.services.tokenizer.tool_calls import ToolCallParser
from flotilla.services.tokenizer.tool_formats import FORMATS

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
TOOLS = [  # closed schemas: random logits would otherwise invent properties at length
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PROMPT = [1, 2, 3]


def generate(outputs: StructuredOutputs, tok: Tokenizer, spec: GuidedDecoding, seed: int,
             temperature: float = 1.0, max_tokens: int = 120,
             repetition_penalty: float = 1.0, device: str = "cpu") -> tuple[list[int], bool]:
    """Sample under `spec` from random logits; (generated ids without the stop, stopped?)."""
    stops = tok.end_of_generation_ids()
    params = SamplingParams(temperature=temperature, seed=seed,
                            repetition_penalty=repetition_penalty)
    params.guided = outputs.request(spec, stops)
    logits_gen = torch.Generator().manual_seed(seed)
    sample_gen = torch.Generator(device).manual_seed(seed)
    sampler, ids = Sampler(), []
    for _ in range(max_tokens):
        logits = (torch.randn(1, tok.vocab_size, generator=logits_gen) * 4).to(device)
        batch = SamplingBatch.build([params], [sample_gen], [PROMPT + ids], [len(PROMPT)],
                                    tok.vocab_size, torch.device(device))
        token = int(sampler(logits, batch).token_ids[0])
        if token in stops:
            return ids, True
        ids.append(token)
    return ids, False


def spec_of(**kw: Any) -> GuidedDecoding:
    req = TextRequest(request_id="r", model="m", kind="chat", stream_subject="s",
                      messages=[{"role": "user", "content": "x"}], **kw)
    spec = guided_spec(req, FORMATS["hermes"])
    assert spec is not None
    return spec


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_json_schema_outputs_always_validate(outputs: StructuredOutputs, smollm2: Tokenizer,
                                             temperature: float) -> None:
    spec = spec_of(response_format={"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": PERSON}})
    for seed in range(6):  # penalties and the mask combine
        ids, stopped = generate(outputs, smollm2, spec, seed, temperature,
                                repetition_penalty=1.3 if seed % 2 else 1.0)
        assert stopped, smollm2.decode(ids)
        assert not set(ids) & smollm2.special_ids  # no control token inside the JSON
        jsonschema.validate(json.loads(smollm2.decode(ids)), PERSON)


def test_json_object_outputs_are_objects(outputs: StructuredOutputs, smollm2: Tokenizer) -> None:
    spec = spec_of(response_format={"type": "json_object"})
    finished = 0
    for seed in range(8):
        ids, stopped = generate(outputs, smollm2, spec, seed, max_tokens=60)
        if stopped:
            finished += 1
            assert isinstance(json.loads(smollm2.decode(ids)), dict)
    assert finished  # random logits may wander off into long strings; most close in time


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_always_parse(outputs: StructuredOutputs, smollm2: Tokenizer,
                                        fmt_name: str, choice: str) -> None:
    fmt = FORMATS[fmt_name]
    tool_choice: Any = "required" if choice == "required" else {
        "type": "function", "function": {"name": "add"}}
    req = TextRequest(request_id="r", model="m", kind="chat", stream_subject="s",
                      messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                      tool_choice=tool_choice, parallel_tool_calls=False)  # random logits
    # would call again and again otherwise
    spec = guided_spec(req, fmt)
    assert spec is not None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        ids, stopped = generate(outputs, smollm2, spec, seed)
        text = smollm2.decode(ids)
        assert stopped, text
        parser = ToolCallParser(list(schemas), new_id=fmt.new_call_id)
        parsed = [parser.push(text), parser.flush()]
        assert "".join(p.content for p in parsed) == "", text
        calls: dict[int, dict[str, str]] = {}
        for d in (d for p in parsed for d in p.calls):
            slot = calls.setdefault(d.index, {"name": d.name or "", "arguments": ""})
            slot["arguments"] += d.arguments
        assert calls, text
        assert len(calls) == 1
        if choice == "named":
            assert [c["name"] for c in calls.values()] == ["add"]
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_a_grammar_that_fails_to_compile_in_the_engine_is_a_400(
        outputs: StructuredOutputs) -> None:
    """Specs are validated before admission; if one still fails to compile, the engine refuses
    the request (a 400 naming the grammar) instead of generating unconstrained text."""
    bad = GuidedDecoding(kind="json_schema", value='{"type": "no-such-type"}')
    with pytest.raises(RequestError) as err:
        outputs.compile(bad)
    assert err.value.status == 400 and err.value.code == "invalid_grammar"


def test_a_token_outside_the_grammar_fails_only_that_row(outputs: StructuredOutputs,
                                                         smollm2: Tokenizer) -> None:
    """A matcher that rejects a token already generated fails its request (500, the engine's
    fault), and the row beside it samples as if alone."""
    spec = spec_of(response_format={"type": "json_object"})
    stops = smollm2.end_of_generation_ids()
    params, free = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)
    params.guided = outputs.request(spec, stops)
    off_grammar = smollm2.encode("hello", add_special_tokens=False)
    batch = SamplingBatch.build([params, free], [None, None], [PROMPT + off_grammar, PROMPT],
                                [len(PROMPT)] * 2, smollm2.vocab_size, torch.device("cpu"))
    logits = torch.randn(2, smollm2.vocab_size)
    out = Sampler()(logits, batch)
    assert list(out.failed) == [0] and out.failed[0].status == 500
    assert int(out.token_ids[1]) == int(logits[1].argmax())


def test_unconstrained_rows_are_untouched(outputs: StructuredOutputs,
                                          smollm2: Tokenizer) -> None:
    spec = spec_of(response_format={"type": "json_object"})
    free, guided = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)
    guided.guided = outputs.request(spec, smollm2.end_of_generation_ids())
    logits = torch.randn(2, smollm2.vocab_size)
    batch = SamplingBatch.build([free, guided], [None, None], [PROMPT, PROMPT], [3, 3],
                                smollm2.vocab_size, torch.device("cpu"))
    out = Sampler()(logits, batch)
    assert int(out.token_ids[0]) == int(logits[0].argmax())
    assert smollm2.decode([int(out.token_ids[1])]).lstrip().startswith("{")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_json_schema_bitmask_on_cuda(outputs: StructuredOutputs, smollm2: Tokenizer) -> None:
    """The same constrained sampling with logits, bitmask and sampler on the GPU."""
    spec = spec_of(response_format={"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": PERSON}})
    for seed in range(4):
        ids, stopped = generate(outputs, smollm2, spec, seed, 1.0, device="cuda")
        assert stopped, smollm2.decode(ids)
        jsonschema.validate(json.loads(smollm2.decode(ids)), PERSON)
