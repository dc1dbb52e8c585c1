"""The gateway fixtures of tests/gateway (real NATS, a fake tokenizer, a real gateway in this
process), plus the official `anthropic` client pointed at that gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from flotilla.services.gateway.service import GatewayService
from tests.gateway.conftest import bus, client, gateway, model, tokenizer  # noqa: F401


@pytest.fixture(scope="package")
async def claude(gateway: GatewayService) -> AsyncIterator[object]:  # noqa: F811
    import anthropic

    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="unused",
                                        max_retries=0, timeout=15) as c:
        yield c
