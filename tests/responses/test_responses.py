"""/v1/responses through the official `openai` SDK against a real gateway (fake tokenizer):
every response and stream event validates against OpenAI's own spec, and the request reaches the
tokenizer as the chat conversation it stands for."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_openai
from tests.responses.official import validate_event

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


async def raw_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    async with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        name = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                out.append(data)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    for e in out:
        validate_event(e)
    return out


async def test_plain_response(oai: AsyncOpenAI, client: httpx.AsyncClient, model: str,
                              tokenizer: FakeTokenizer) -> None:
    r = await oai.responses.create(model=model, input="hi", instructions="Be brief.")
    assert r.status == "completed" and r.output_text == "Hello world !"
    assert r.usage is not None and r.usage.input_tokens == 7 and r.usage.output_tokens == 3
    assert r.usage.input_tokens_details.cached_tokens == 2
    assert tokenizer.requests[-1].messages == [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "hi"}]
    raw = await client.post("/v1/responses", json={"model": model, "input": "hi"})
    validate_openai("Response", raw.json())
    stored = await oai.responses.retrieve(r.id)
    assert stored.output_text == "Hello world !"
    validate_openai("Response", (await client.get(f"/v1/responses/{r.id}")).json())


async def test_streamed_response(oai: AsyncOpenAI, client: httpx.AsyncClient,
                                 model: str) -> None:
    async with oai.responses.stream(model=model, input="hi") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == "Hello world !" == final.output_text
    events = await raw_events(client, {"model": model, "input": "hi"})
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]


async def test_function_tool_round_trip(oai: AsyncOpenAI, model: str,
                                        tokenizer: FakeTokenizer) -> None:
    first = await oai.responses.create(model=model, input="tools", tools=[WEATHER])
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    second = await oai.responses.create(
        model=model, previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == "Hello world !"
    messages = tokenizer.requests[-1].messages
    assert messages is not None
    assert messages[0] == {"role": "user", "content": "tools"}
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}


async def test_streamed_function_call_events(client: httpx.AsyncClient, model: str) -> None:
    events = await raw_events(client, {"model": model, "input": "tools", "tools": [WEATHER]})
    deltas = [e["delta"] for e in events
              if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == '{"city": "Paris"}'
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["name"] == "get_weather"


async def test_reasoning_items(oai: AsyncOpenAI, client: httpx.AsyncClient, model: str,
                               tokenizer: FakeTokenizer) -> None:
    r = await oai.responses.create(model=model, input="think", reasoning={"effort": "low"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think."
    assert tokenizer.requests[-1].reasoning_effort == "low"
    events = await raw_events(client, {"model": model, "input": "think"})
    assert "response.reasoning_text.delta" in [e["type"] for e in events]
    # the chain carries the reasoning back as the assistant's reasoning_content
    await oai.responses.create(model=model, input="hi", previous_response_id=r.id)
    sent = tokenizer.requests[-1].messages
    assert sent is not None and sent[1] == {"role": "assistant", "content": "42",
                                            "reasoning_content": "Let me think."}


async def test_json_schema_format_reaches_the_grammar_path(oai: AsyncOpenAI, model: str,
                                                            tokenizer: FakeTokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    await oai.responses.create(model=model, input="hi", text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    assert tokenizer.requests[-1].response_format == {
        "type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                               "strict": True}}


async def test_sampling_and_limits(oai: AsyncOpenAI, model: str,
                                   tokenizer: FakeTokenizer) -> None:
    await oai.responses.create(model=model, input="hi", temperature=0.3, top_p=0.8,
                               max_output_tokens=50, parallel_tool_calls=False,
                               tools=[WEATHER], tool_choice={"type": "function",
                                                             "name": "get_weather"},
                               metadata={"k": "v"}, store=False)
    sent = tokenizer.requests[-1]
    assert sent.sampling.temperature == 0.3 and sent.sampling.top_p == 0.8
    assert sent.sampling.max_tokens == 50 and sent.parallel_tool_calls is False
    assert sent.tool_choice == {"type": "function", "function": {"name": "get_weather"}}


async def test_store_false_is_not_kept(oai: AsyncOpenAI, model: str) -> None:
    r = await oai.responses.create(model=model, input="hi", store=False)
    with pytest.raises(NotFoundError):
        await oai.responses.retrieve(r.id)


async def test_delete_and_input_items(oai: AsyncOpenAI, client: httpx.AsyncClient,
                                      model: str) -> None:
    r = await oai.responses.create(model=model, input=[
        {"role": "user", "content": "one"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    items = await oai.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["one", "hi"]
    raw = (await client.get(f"/v1/responses/{r.id}/input_items")).json()
    validate_openai("ResponseItemList", raw)
    assert raw["data"][0]["content"][0]["text"] == "hi"  # default order: newest first
    await oai.responses.delete(r.id)
    with pytest.raises(NotFoundError):
        await oai.responses.retrieve(r.id)


async def test_unknown_previous_response(oai: AsyncOpenAI, model: str) -> None:
    with pytest.raises(NotFoundError) as err:
        await oai.responses.create(model=model, input="hi", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"


async def test_background_and_cancel(oai: AsyncOpenAI, model: str,
                                     tokenizer: FakeTokenizer) -> None:
    done = await oai.responses.create(model=model, input="hi", background=True)
    assert done.status in ("queued", "in_progress")
    for _ in range(400):  # up to 20 s: a loaded CI machine
        done = await oai.responses.retrieve(done.id)
        if done.status == "completed":
            break
        await asyncio.sleep(0.05)
    assert done.output_text == "Hello world !"
    slow = await oai.responses.create(model=model, input="slow", background=True)
    await asyncio.sleep(0.3)
    cancelled = await oai.responses.cancel(slow.id)
    # the cancel waits (up to 5 s) for the run to stop and be saved; on a loaded machine the
    # stored status may turn `cancelled` just after it answers
    for _ in range(100):
        if cancelled.status == "cancelled":
            break
        await asyncio.sleep(0.1)
        cancelled = await oai.responses.retrieve(slow.id)
    assert cancelled.status == "cancelled"
    await asyncio.sleep(0.2)
    assert any(c.request_id.startswith(slow.id.removeprefix("resp_")) for c in tokenizer.cancels)


async def test_refusal_is_an_http_error(oai: AsyncOpenAI, model: str) -> None:
    with pytest.raises(BadRequestError) as err:
        await oai.responses.create(model=model, input="refuse")
    assert err.value.code == "context_length_exceeded"


async def test_failure_mid_stream(client: httpx.AsyncClient, model: str) -> None:
    r = await client.post("/v1/responses", json={"model": model, "input": "error",
                                                 "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    for e in events:
        validate_event(e)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "mcp", "server_label": "nope"}]},
     "tools[0].server_label"),
    ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "hi", "background": True, "store": False}, "background"),
])
async def test_bad_requests(client: httpx.AsyncClient, model: str, body: dict[str, Any],
                            param: str) -> None:
    r = await client.post("/v1/responses", json={"model": model, **body})
    assert r.status_code == 400, r.text
    validate_openai("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param
