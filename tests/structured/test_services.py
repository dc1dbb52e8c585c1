"""Through the real services (engine, tokenizer and gateway in this process, the real NATS, the
SmolLM2 model) with the official `openai` client: a forced tool call and its round trip, JSON
that always validates (a nested schema: $ref, anyOf, enums, arrays), refusals of bad schemas and
of keywords that cannot be enforced, regex and choice outputs from the real engine, and
logprobs in chat and completions."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.model_cache import ensure_default_model
from flotilla.libs.common.settings import EngineSettings, GatewaySettings, TokenizerSettings
from flotilla.services.engine.service import EngineService
from flotilla.services.gateway.service import GatewayService
from flotilla.services.tokenizer.service import TokenizerService
from tests.endpoints import NATS_URL

NATS = NATS_URL
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
PET = {"type": "object", "additionalProperties": False, "required": ["kind", "name"],
       "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                      "name": {"type": "string", "maxLength": 8}}}
OWNER = {"$defs": {"Pet": PET}, "type": "object", "additionalProperties": False,
         "required": ["owner", "pets", "contact"],
         "properties": {
             "owner": {"type": "string", "maxLength": 8},
             "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}, "minItems": 1,
                      "maxItems": 2},
             "contact": {"anyOf": [{"type": "null"}, {
                 "type": "object", "additionalProperties": False, "required": ["age"],
                 "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}}}]}}}


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    """The three services on a model name of their own (apart from other suites' subjects)."""
    model = f"structured-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = dict(nats_url=NATS, model=str(ensure_default_model()),
                                  served_model_name=model, log_level="WARNING")
    bus = await Bus.connect(NATS, "structured-test")
    services = [EngineService(EngineSettings(**common, kvcache_mem_mib=512), bus),
                TokenizerService(TokenizerSettings(**common), bus),
                GatewayService(GatewaySettings(nats_url=NATS, port=0, log_level="WARNING",
                                               request_timeout_s=60.0), bus)]
    started: list[Any] = []
    try:
        for svc in services:
            await svc.start()
            started.append(svc)
        gateway = services[2]
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            for _ in range(200):  # until the gateway has seen the tokenizer announce
                if any(m["id"] == model for m in (await http.get("/v1/models")).json()["data"]):
                    break
                await asyncio.sleep(0.1)
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused",
                                      timeout=600, max_retries=0) as sdk:
            yield sdk, model
    finally:
        for svc in reversed(started):
            await svc.stop()
        await bus.close()


async def test_tool_round_trip_with_tool_choice_required(
        client: tuple[openai.AsyncOpenAI, str]) -> None:
    sdk, model = client
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    # one call: greedy SmolLM2 would repeat it until max_tokens if more were allowed
    forced: dict[str, Any] = dict(model=model, tools=[WEATHER], tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_tokens=60)
    first = await sdk.chat.completions.create(messages=messages, **forced)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    # the same request streamed: id and name first, then argument fragments, same call
    stream = await sdk.chat.completions.create(messages=messages, stream=True, **forced)
    pieces: list[Any] = []
    finish = None
    async for chunk in stream:
        for c in chunk.choices:
            pieces += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"temperature_c": 18, "sky": "sunny"})})
    final = await sdk.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                              tool_choice="none", temperature=0, max_tokens=24)
    answer = final.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.slow
async def test_a_hundred_json_schema_samples_all_validate(
        client: tuple[openai.AsyncOpenAI, str]) -> None:
    sdk, model = client
    response_format: Any = {"type": "json_schema",
                            "json_schema": {"name": "owner", "schema": OWNER, "strict": True}}

    async def one(seed: int) -> tuple[str | None, str | None]:
        r = await sdk.chat.completions.create(
            # 128 tokens bound the longest valid answer: three strings of 8 characters of
            # 3-byte UTF-8 (up to 72 byte-level tokens) and ~50 of structure
            model=model, temperature=1.0, max_tokens=128, seed=seed,
            response_format=response_format,
            messages=[{"role": "user", "content": "Describe a pet owner in JSON."}])
        return r.choices[0].message.content, r.choices[0].finish_reason

    results = await asyncio.gather(*(one(seed) for seed in range(100)))
    assert all(reason == "stop" for _, reason in results), results
    owners = [json.loads(text or "") for text, _ in results]
    for owner in owners:
        jsonschema.validate(owner, OWNER)
    assert len({json.dumps(o) for o in owners}) > 10  # sampled, not one answer repeated


@pytest.mark.parametrize("schema,param", [
    ({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}},
     "properties.n.not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
])
async def test_keywords_that_cannot_be_enforced_are_400s(
        client: tuple[openai.AsyncOpenAI, str], schema: dict[str, Any], param: str) -> None:
    sdk, model = client
    with pytest.raises(openai.BadRequestError) as err:
        await sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "s",
                                                                    "schema": schema}})
    assert err.value.body["param"] == f"response_format.json_schema.schema.{param}"  # type: ignore


async def test_regex_and_choice_from_the_engine(client: tuple[openai.AsyncOpenAI, str]) -> None:
    """The internal spellings the gateway maps vLLM's and llama.cpp's fields onto, sent to the
    tokenizer as the gateway does: the real engine compiles them (regex: its own grammar kind)."""
    from flotilla.libs.common.messages import SamplingOptions
    from tests.tokenizer.harness import gateway, request

    _, model = client
    bus = await Bus.connect(NATS, "structured-kinds")
    try:
        for fmt, check in (
                ({"type": "regex", "regex": "[A-Z][a-z]{2,6}-[0-9]{2}"},
                 lambda t: re.fullmatch("[A-Z][a-z]{2,6}-[0-9]{2}", t)),
                ({"type": "choice", "choice": ["Paris", "Lyon", "Nice"]},
                 lambda t: t in ("Paris", "Lyon", "Nice"))):
            for seed in range(3):
                out = await gateway(bus, model, request(
                    messages=[{"role": "user", "content": "Name a French city."}],
                    response_format=fmt, sampling=SamplingOptions(
                        temperature=1.0, seed=seed, max_tokens=24)), timeout=30.0)
                assert out.admission.accepted and out.frames[-1].kind == "final", out
                assert check(out.text), out.text
    finally:
        await bus.close()


async def test_json_object_and_bad_schemas(client: tuple[openai.AsyncOpenAI, str]) -> None:
    sdk, model = client
    r = await sdk.chat.completions.create(
        model=model, temperature=0, max_tokens=40, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    else:  # cut at max_tokens: still a JSON object prefix
        assert (r.choices[0].message.content or "").startswith("{")
    for schema in ({"type": "no-such-type"}, {"type": "string", "maxLength": 10**7}):
        with pytest.raises(openai.BadRequestError) as err:
            await sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "s", "schema": schema}})
        assert err.value.body["param"] == "response_format.json_schema.schema"  # type: ignore


async def test_logprobs_in_chat_and_completions(client: tuple[openai.AsyncOpenAI, str]) -> None:
    sdk, model = client
    chat = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], temperature=0,
        max_tokens=8, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy: a top one
    done = await sdk.completions.create(model=model, prompt="The capital of France is",
                                        temperature=0, max_tokens=6, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == done.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs or [])
    offsets = lp.text_offset or []
    assert offsets == sorted(offsets) and offsets[0] == 0
    echoed = await sdk.completions.create(model=model, prompt="The capital of France is",
                                          temperature=0, max_tokens=6, logprobs=2, echo=True)
    lp = echoed.choices[0].logprobs
    assert lp is not None and echoed.choices[0].text.startswith("The capital of France is")
    # With echo, the logprobs cover the prompt too (as OpenAI's legacy API and lm-eval expect):
    # the tokens spell the whole text, the first prompt token has no logprob.
    assert "".join(lp.tokens or []) == echoed.choices[0].text
    assert (lp.token_logprobs or [0.0])[0] is None and (lp.text_offset or [])[0] == 0
    assert lp.text_offset == sorted(lp.text_offset or [])
