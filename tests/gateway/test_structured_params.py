"""Structured-output and reasoning parameters at the gateway: response_format reaches the
tokenizer as sent, reasoning sent back in history reaches templates, and the reasoning text is
named as the `reasoning_field` setting says, streamed or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from flotilla.libs.common.bus import Bus
from flotilla.services.gateway.service import GatewayService
from tests.gateway.conftest import chat, decode_events, gateway_settings, read_sse
from tests.gateway.fakes import FakeTokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


async def test_response_format_and_reasoning_history_reach_the_tokenizer(
        client: httpx.AsyncClient, model: str, tokenizer: FakeTokenizer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning": "because"},
                {"role": "user", "content": "again"}]
    r = await client.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "response_format": fmt, "tools": []})
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("chatcmpl-")
    req = next(q for q in tokenizer.requests if q.request_id.startswith(rid))
    assert req.response_format == fmt
    assert req.messages is not None and req.messages[1] == {
        "role": "assistant", "content": "a", "reasoning_content": "because"}
    r = await client.post("/v1/completions", json={
        "model": model, "prompt": "x", "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("cmpl-")
    req = next(q for q in tokenizer.requests if q.request_id.startswith(rid))
    assert req.response_format == {"type": "json_object"}


@pytest.fixture(params=["reasoning", "both"])
async def named(request: pytest.FixtureRequest, bus: Bus,
                tokenizer: FakeTokenizer) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    service = GatewayService(gateway_settings(reasoning_field=request.param), bus)
    await service.start()
    for _ in range(100):
        if await service.state.registry.get(tokenizer.model) is not None:
            break
        await asyncio.sleep(0.05)
    async with httpx.AsyncClient(base_url=service.url, timeout=15) as c:
        yield c, request.param
    await service.stop()


async def test_reasoning_field_setting(named: tuple[httpx.AsyncClient, str], model: str) -> None:
    client, field = named
    names = {"reasoning": ["reasoning"], "both": ["reasoning_content", "reasoning"]}[field]
    r = await client.post("/v1/chat/completions", json=chat(model, "think"))
    message = r.json()["choices"][0]["message"]
    assert {k: message.get(k) for k in ("reasoning_content", "reasoning")} == {
        k: ("Let me think." if k in names else None) for k in ("reasoning_content", "reasoning")}
    async with client.stream("POST", "/v1/chat/completions",
                             json=chat(model, "think", stream=True)) as s:
        chunks = decode_events(await read_sse(s))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert {k: "Let me think." for k in names} in deltas
