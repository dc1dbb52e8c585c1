"""The gateway fixtures of tests/gateway (real NATS, a fake tokenizer, a real gateway in this
process), plus the official `openai` client pointed at that gateway.

The gateway here allows 5 s without a stream frame (tests/gateway: 1 s): client and gateway
share this process's event loop, and the SDK's first parse of its large stream-event types
holds the loop for about a second."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from flotilla.libs.common.bus import Bus
from flotilla.services.gateway.service import GatewayService
from tests.gateway.conftest import bus, client, gateway_settings, model, tokenizer  # noqa: F401
from tests.gateway.fakes import FakeTokenizer


@pytest.fixture(scope="package")
async def gateway(bus: Bus, tokenizer: FakeTokenizer) -> AsyncIterator[GatewayService]:  # noqa: F811
    service = GatewayService(gateway_settings(heartbeat_timeout_s=5.0), bus)
    await service.start()
    for _ in range(100):
        if await service.state.registry.get(tokenizer.model) is not None:
            break
        await asyncio.sleep(0.05)
    yield service
    await service.stop()


@pytest.fixture(scope="package")
async def oai(gateway: GatewayService) -> AsyncIterator[object]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                           timeout=15) as c:
        yield c
