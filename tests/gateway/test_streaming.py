"""Streaming over real HTTP: chunk order and shapes (against OpenAI's published schemas), errors
before and after the first byte, and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Cancel
from tests.gateway.conftest import HEARTBEAT_TIMEOUT_S, chat, decode_events, read_sse
from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_completion_chunk, validate_openai, validate_ours


async def stream_chat(client: httpx.AsyncClient, body: dict) -> list[dict]:
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = decode_events(await read_sse(r))
    for chunk in chunks:
        if "error" not in chunk:
            validate_openai("CreateChatCompletionStreamResponse", chunk)
            validate_ours("ChatCompletionChunk", chunk)
    return chunks


async def test_chat_stream_order_and_usage(client: httpx.AsyncClient, model: str) -> None:
    chunks = await stream_chat(client, chat(model, stream=True,
                                            stream_options={"include_usage": True}))
    first, *middle, last_choice, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == "Hello world !"
    assert all(c["choices"][0]["finish_reason"] is None for c in [first, *middle])
    assert last_choice["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 10
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


async def test_chat_stream_without_usage_has_no_usage_chunk(client: httpx.AsyncClient,
                                                            model: str) -> None:
    chunks = await stream_chat(client, chat(model, stream=True))
    assert all(c["choices"] for c in chunks) and all("usage" not in c for c in chunks)


async def test_two_choices_interleave_with_their_indices(client: httpx.AsyncClient,
                                                         model: str) -> None:
    chunks = await stream_chat(client, chat(model, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    indices = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert indices[:2] == [0, 1]  # both role chunks first
    assert sorted(set(indices)) == [0, 1]
    content_order = [c["choices"][0]["index"] for c in chunks
                     if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert content_order != sorted(content_order), "the two choices should interleave"
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and
                c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(m["delta"].get("content") or "" for m in mine) == "Hello world !"
        assert [m["finish_reason"] for m in mine].count("stop") == 1
        assert mine[-1]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_streamed_tool_calls_and_reasoning(client: httpx.AsyncClient, model: str) -> None:
    chunks = await stream_chat(client, chat(model, "tools", stream=True, tools=[]))
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0] == {"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": '}}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    chunks = await stream_chat(client, chat(model, "think", stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[1] == {"reasoning_content": "Let me think."} and deltas[2] == {"content": "42"}


async def test_completion_stream(client: httpx.AsyncClient, model: str) -> None:
    body = {"model": model, "prompt": ["a", "b"], "stream": True, "logprobs": 1,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = decode_events(await read_sse(r))
    for chunk in chunks:
        validate_completion_chunk(chunk)
        validate_ours("Completion", chunk)
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == {0: "Hello world !", 1: "Hello world !"}
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in chunks[:-1]
               if c["choices"][0]["index"] == 0 and c["choices"][0]["logprobs"]]
    assert offsets == [0, 5, 11]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 14


async def test_refused_admission_is_an_http_error_before_any_event(client: httpx.AsyncClient,
                                                                   model: str) -> None:
    for n in (1, 2):
        async with client.stream("POST", "/v1/chat/completions",
                                 json=chat(model, "refuse", n=n, stream=True)) as r:
            body = json.loads(await r.aread())
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        validate_openai("ErrorResponse", body)
        assert body["error"]["code"] == "context_length_exceeded"


async def test_no_tokenizer_for_a_listed_model_is_503(client: httpx.AsyncClient, bus: Bus,
                                                      gateway) -> None:  # type: ignore[no-untyped-def]
    from flotilla.libs.common.messages import Announcement

    ghost = "test-gw-ghost-model"
    await gateway.state.registry.record(Announcement(service="tokenizer", instance="ghost",
                                                     model=ghost, max_model_len=10))
    r = await client.post("/v1/chat/completions", json=chat(ghost, stream=True))
    assert r.status_code == 503, r.text
    validate_openai("ErrorResponse", r.json())
    assert r.json()["error"]["type"] == "service_unavailable"


async def test_dead_tokenizer_ends_stream_with_error_then_done(client: httpx.AsyncClient,
                                                                model: str,
                                                                tokenizer: FakeTokenizer) -> None:
    started = time.monotonic()
    chunks = await stream_chat(client, chat(model, "die", stream=True))
    elapsed = time.monotonic() - started
    assert elapsed < HEARTBEAT_TIMEOUT_S + 3, elapsed
    assert chunks[1]["choices"][0]["delta"] == {"content": "partial"}
    error = chunks[-1]
    validate_openai("ErrorResponse", error)
    assert error["error"]["code"] == "service_unavailable"
    rid = chunks[0]["id"].removeprefix("chatcmpl-")  # the silent choice is cancelled too
    assert await _wait_for(lambda: tokenizer.cancelled(f"{rid}-0"))
    # An error frame from upstream ends the stream the same way, without waiting.
    chunks = await stream_chat(client, chat(model, "error", stream=True))
    assert chunks[-1]["error"]["message"] == "the engine went away"


async def test_dead_tokenizer_fails_a_non_streaming_request_with_503(client: httpx.AsyncClient,
                                                                      model: str) -> None:
    r = await client.post("/v1/chat/completions", json=chat(model, "die"))
    assert r.status_code == 503
    validate_openai("ErrorResponse", r.json())


async def _cancels(bus: Bus) -> tuple[list[Cancel], Any]:
    seen: list[Cancel] = []

    async def on_cancel(c: Cancel) -> None:
        seen.append(c)

    return seen, await bus.subscribe(subjects.CANCEL, Cancel, on_cancel)


async def _wait_for(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


async def test_stream_disconnect_cancels_every_choice(gateway, bus: Bus,  # type: ignore[no-untyped-def]
                                                      model: str,
                                                      tokenizer: FakeTokenizer) -> None:
    seen, sub = await _cancels(bus)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as own:
        async with own.stream("POST", "/v1/chat/completions",
                              json=chat(model, "slow", n=2, stream=True)) as r:
            lines = r.aiter_lines()
            first = await anext(lines)
            rid = json.loads(first.removeprefix("data: "))["id"].removeprefix("chatcmpl-")
            await anext(lines)
    # Leaving the block closed the connection mid-stream.
    wanted = {f"{rid}-0", f"{rid}-1"}
    assert await _wait_for(lambda: wanted <= {c.request_id for c in seen}), seen
    assert {c.reason for c in seen if c.request_id in wanted} == {"client_disconnect"}
    await sub.unsubscribe()


async def test_non_streaming_disconnect_cancels(gateway, bus: Bus, model: str,  # type: ignore[no-untyped-def]
                                                tokenizer: FakeTokenizer) -> None:
    seen, sub = await _cancels(bus)
    before = len(tokenizer.requests)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=0.6) as own:
        try:
            await own.post("/v1/chat/completions", json=chat(model, "slow"))
        except httpx.ReadTimeout:
            pass
    rid = next(q.request_id for q in tokenizer.requests[before:] if q.messages and
               q.messages[-1]["content"] == "slow")
    assert await _wait_for(lambda: rid in {c.request_id for c in seen}), seen
    await sub.unsubscribe()
