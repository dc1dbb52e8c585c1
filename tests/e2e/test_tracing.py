"""One request yields spans from gateway, tokenizer and engine under one trace id.

The three real services run in this process (one event loop, the real NATS, the real SmolLM2
model) so one in-memory span exporter sees them all, on the test NATS (tests/endpoints.py; the
launcher-started suite of the other e2e tests has a private NATS of its own). A unique
served-model name keeps this suite's subjects apart from other runs on the same NATS.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.model_cache import ensure_default_model
from flotilla.libs.common.settings import EngineSettings, GatewaySettings, TokenizerSettings
from flotilla.services.engine.service import EngineService
from flotilla.services.gateway.service import GatewayService
from flotilla.services.tokenizer.service import TokenizerService
from tests.endpoints import NATS_URL
from tests.tracing import memory_exporter

NATS = NATS_URL




async def test_one_trace_across_services() -> None:
    exporter = memory_exporter()
    model = f"trace-{uuid.uuid4().hex[:8]}"
    path = str(ensure_default_model())
    common = dict(nats_url=NATS, model=path, served_model_name=model)
    bus = await Bus.connect(NATS, "trace-test")
    engine = EngineService(EngineSettings(**common, kvcache_mem_mib=64), bus)
    tokenizer = TokenizerService(TokenizerSettings(**common), bus)
    gateway = GatewayService(GatewaySettings(nats_url=NATS, port=0), bus)
    started = []
    try:
        for svc in (engine, tokenizer, gateway):
            await svc.start()
            started.append(svc)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:
            for _ in range(100):  # wait until the gateway has seen the tokenizer announce
                r = await http.get("/v1/models")
                if any(m["id"] == model for m in r.json()["data"]):
                    break
                await asyncio.sleep(0.1)
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4, "temperature": 0}
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
    finally:
        for svc in reversed(started):
            await svc.stop()
        await bus.close()
    spans = exporter.get_finished_spans()
    gw = [s for s in spans if s.name == "gateway.request"
          and (s.attributes or {}).get("url.path") == "/v1/chat/completions"]
    assert gw, [s.name for s in spans]
    trace_id = gw[-1].context.trace_id
    names = {s.name for s in spans if s.context.trace_id == trace_id}
    assert {"gateway.request", "tokenizer.generate", "engine.request"} <= names, names
