"""Fixtures: the real NATS on loopback, a fake tokenizer for a unique model, and a real gateway
(uvicorn on an ephemeral port) in this test process."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.settings import GatewaySettings
from flotilla.services.gateway.service import GatewayService
from tests.endpoints import NATS_URL
from tests.gateway.fakes import FakeTokenizer

HEARTBEAT_TIMEOUT_S = 1.0


def gateway_settings(**overrides: Any) -> GatewaySettings:
    values: dict[str, Any] = dict(
        nats_url=NATS_URL, redis_url=None, host="127.0.0.1", port=0, heartbeat_interval_s=0.1,
        # model_ttl_s: long enough that tests holding the event loop on a loaded machine do not
        # outlive the fake tokenizer's announcements (0.5 s apart)
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, request_timeout_s=3.0, model_ttl_s=15.0,
        tools_timeout_s=0.5, max_n=4, discovery_interval_s=0.5, log_level="WARNING")
    values.update(overrides)
    return GatewaySettings(**values)


@pytest.fixture(scope="package")
async def bus() -> AsyncIterator[Bus]:
    b = await Bus.connect(NATS_URL, "test-gateway")
    yield b
    await b.close()


@pytest.fixture(scope="package")
def model() -> str:
    # A '/' as in hub ids: exercises /v1/models/{model} and subject-token escaping.
    return f"test-gw-{uuid.uuid4().hex[:8]}/tiny"


@pytest.fixture(scope="package")
async def tokenizer(bus: Bus, model: str) -> AsyncIterator[FakeTokenizer]:
    fake = FakeTokenizer(bus, model)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture(scope="package")
async def gateway(bus: Bus, tokenizer: FakeTokenizer) -> AsyncIterator[GatewayService]:
    service = GatewayService(gateway_settings(), bus)
    await service.start()
    for _ in range(100):
        if await service.state.registry.get(tokenizer.model) is not None:
            break
        await asyncio.sleep(0.05)
    yield service
    await service.stop()


@pytest.fixture(scope="package")
async def client(gateway: GatewayService) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=15) as c:
        yield c


def chat(model: str, content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


async def read_sse(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
    return events


def decode_events(events: list[str]) -> list[dict[str, Any]]:
    assert events and events[-1] == "[DONE]", f"stream must end with [DONE]: {events[-3:]}"
    assert "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]
