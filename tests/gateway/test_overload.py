"""Overload control and deadlines at the gateway, over real HTTP and the real NATS: the
in-flight cap answers 503 with Retry-After and never queues; overload refusals from upstream
keep their Retry-After; a request's deadline ends its response and cancels its choices."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from flotilla.libs.common.bus import Bus
from flotilla.services.gateway.service import GatewayService
from tests.gateway.conftest import chat, gateway_settings, read_sse
from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_openai


@pytest.fixture
async def small_gateway(bus: Bus, tokenizer: FakeTokenizer) -> AsyncIterator[GatewayService]:
    service = GatewayService(gateway_settings(max_in_flight=2, overload_retry_after_s=1.5), bus)
    await service.start()
    for _ in range(100):
        if await service.state.registry.get(tokenizer.model) is not None:
            break
        await asyncio.sleep(0.05)
    yield service
    await service.stop()


async def _first_chunk(response: httpx.Response) -> None:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            return


async def test_in_flight_cap_refuses_at_once_with_retry_after(small_gateway: GatewayService,
                                                             model: str) -> None:
    async with httpx.AsyncClient(base_url=small_gateway.url, timeout=10) as http:
        streams = [http.stream("POST", "/v1/chat/completions",
                               json=chat(model, "slow", stream=True)) for _ in range(2)]
        opened = [await s.__aenter__() for s in streams]
        for response in opened:
            await _first_chunk(response)
        assert small_gateway.state.in_flight.count == 2
        started = time.monotonic()
        r = await http.post("/v1/chat/completions", json=chat(model))
        assert time.monotonic() - started < 0.5  # refused at once, not queued
        assert r.status_code == 503 and r.headers["retry-after"] == "2"  # 1.5 s, rounded up
        validate_openai("ErrorResponse", r.json())
        assert r.json()["error"]["code"] == "overloaded"
        assert small_gateway.state.in_flight.refused == 1
        # what tells a client how the server is doing is never refused
        assert (await http.get("/v1/models")).status_code == 200
        for stream in streams:
            await stream.__aexit__(None, None, None)
        for _ in range(100):  # the closed streams give their slots back
            if small_gateway.state.in_flight.count == 0:
                break
            await asyncio.sleep(0.02)
        assert small_gateway.state.in_flight.count == 0
        r = await http.post("/v1/chat/completions", json=chat(model, max_tokens=3))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("scenario,status,retry_after", [("busy", 503, "3"),
                                                          ("limited", 429, "1")])
async def test_upstream_retry_after_becomes_the_header(client: httpx.AsyncClient, model: str,
                                                      scenario: str, status: int,
                                                      retry_after: str) -> None:
    r = await client.post("/v1/chat/completions", json=chat(model, scenario))
    assert r.status_code == status, r.text
    assert r.headers["retry-after"] == retry_after  # whole seconds, rounded up
    validate_openai("ErrorResponse", r.json())


async def test_errors_without_retry_after_have_no_header(client: httpx.AsyncClient,
                                                         model: str) -> None:
    r = await client.post("/v1/chat/completions", json=chat(model, "refuse"))
    assert r.status_code == 400 and "retry-after" not in r.headers


async def test_deadline_ends_a_stream_and_cancels_it(client: httpx.AsyncClient, model: str,
                                                     tokenizer: FakeTokenizer) -> None:
    started, sent_at = time.monotonic(), time.time()
    async with client.stream("POST", "/v1/chat/completions", json=chat(model, "slow", stream=True),
                             headers={"X-Request-Timeout": "1"}) as r:
        assert r.status_code == 200
        events = await read_sse(r)
    elapsed = time.monotonic() - started
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    validate_openai("ErrorResponse", error)
    assert error["error"]["code"] == "deadline_exceeded"
    assert len(events) > 4  # it streamed until the deadline
    assert 0.9 < elapsed < 1.8, elapsed
    rid = json.loads(events[0])["id"].removeprefix("chatcmpl-")
    [sent] = [q for q in tokenizer.requests if q.request_id == f"{rid}-0"]
    assert sent.deadline is not None and abs(sent.deadline - (sent_at + 1)) < 0.3
    for _ in range(50):
        if tokenizer.cancelled(f"{rid}-0"):
            break
        await asyncio.sleep(0.02)
    assert [c.reason for c in tokenizer.cancels if c.request_id == f"{rid}-0"] == ["deadline"]


async def test_deadline_of_a_non_streamed_request_is_a_504(client: httpx.AsyncClient,
                                                          model: str) -> None:
    started = time.monotonic()
    r = await client.post("/v1/completions", json={"model": model, "prompt": "slow", "n": 2},
                          headers={"X-Request-Timeout": "1.2"})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded"
    validate_openai("ErrorResponse", r.json())
    assert 1.1 < time.monotonic() - started < 2.0


async def test_default_deadline_and_longer_asks_are_the_server_setting(
        client: httpx.AsyncClient, gateway: GatewayService, model: str,
        tokenizer: FakeTokenizer) -> None:
    limit = gateway.settings.request_deadline_s
    for headers in ({}, {"X-Request-Timeout": str(limit * 100)}):
        sent_at = time.time()
        r = await client.post("/v1/chat/completions", json=chat(model), headers=headers)
        assert r.status_code == 200
        rid = r.json()["id"].removeprefix("chatcmpl-")
        [sent] = [q for q in tokenizer.requests if q.request_id == f"{rid}-0"]
        assert sent.deadline is not None and abs(sent.deadline - (sent_at + limit)) < 1
