"""The three services (engine on CPU in float32, tokenizer, gateway) in this process on the real
NATS, serving one model directory under a name of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.settings import EngineSettings, GatewaySettings, TokenizerSettings
from flotilla.services.engine.service import EngineService
from flotilla.services.gateway.service import GatewayService
from flotilla.services.tokenizer.service import TokenizerService
from tests.endpoints import NATS_URL


@contextlib.asynccontextmanager
async def served(path: Path, model: str) -> AsyncIterator[str]:
    """Serve `path` as `model`; yields the gateway's URL once it lists the model."""
    common: dict[str, Any] = dict(
        nats_url=NATS_URL, model=str(path), served_model_name=model, log_level="WARNING"
    )
    bus = await Bus.connect(NATS_URL, f"pooling-test-{model}")
    engine = EngineSettings(
        **common,
        device="cpu",
        quantization="none",
        kvcache_mem_mib=16,
        max_num_batched_tokens=64,
        max_waiting_requests=8,
    )
    gateway = GatewaySettings(
        nats_url=NATS_URL,
        port=0,
        log_level="WARNING",
        request_timeout_s=30.0,
        # every service shares this process's event loop: on a loaded machine an engine step
        # or a client's thread can hold announcements back past the default 5 s and the model
        # drops out of the registry mid-test (a 404 seen once); tests/gateway does the same
        model_ttl_s=15.0,
        max_embedding_inputs=64,
        max_embedding_tokens=2000,
    )
    services = [
        EngineService(engine, bus),
        TokenizerService(TokenizerSettings(**common), bus),
        GatewayService(gateway, bus),
    ]
    started: list[Any] = []
    try:
        for svc in services:
            await svc.start()
            started.append(svc)
        url = services[2].url
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(200):
                if any(m["id"] == model for m in (await http.get("/v1/models")).json()["data"]):
                    break
                await asyncio.sleep(0.1)
        yield url
    finally:
        for svc in reversed(started):
            await svc.stop()
        await bus.close()
