"""The engine owns the context length and publishes it (issue 21): with a KV cache too small
for the model's context, a chat without max_tokens (the OpenAI SDK's default) is served, and
/v1/models reports the engine's length. The three services run in this process on the real
NATS with SmolLM2, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import openai
import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.model_cache import ensure_default_model
from flotilla.libs.common.settings import EngineSettings, GatewaySettings, TokenizerSettings
from flotilla.services.engine.service import EngineService
from flotilla.services.gateway.service import GatewayService
from flotilla.services.tokenizer.service import TokenizerService
from tests.endpoints import NATS_URL

MODEL_CONTEXT = 8192  # SmolLM2-135M-Instruct's max_position_embeddings


async def test_small_kv_cache_chat_without_max_tokens_and_models_report_it() -> None:
    model = f"context-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = dict(nats_url=NATS_URL, model=str(ensure_default_model()),
                                  served_model_name=model, log_level="WARNING",
                                  discovery_interval_s=0.2)
    bus = await Bus.connect(NATS_URL, "context-test")
    engine = EngineService(EngineSettings(**common, kvcache_mem_mib=64), bus)
    services = [engine, TokenizerService(TokenizerSettings(**common), bus),
                GatewayService(GatewaySettings(nats_url=NATS_URL, port=0, log_level="WARNING",
                                               request_timeout_s=60.0), bus)]
    started: list[Any] = []
    try:
        for svc in services:
            await svc.start()
            started.append(svc)
        assert engine._engine is not None
        length = engine._engine.max_model_len
        assert 16 < length < MODEL_CONTEXT  # the KV cache, not the model, bounds it
        gateway = services[2]
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            listed = None
            for _ in range(100):  # until the tokenizer and the engine have announced
                data = (await http.get("/v1/models")).json()["data"]
                listed = next((m for m in data if m["id"] == model), None)
                if listed is not None and listed["max_model_len"] == length:
                    break
                await asyncio.sleep(0.1)
            assert listed is not None and listed["max_model_len"] == length
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused",
                                      timeout=120, max_retries=0) as sdk:
            chat = await sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hello"}])
            assert chat.choices[0].finish_reason in ("stop", "length")
            assert chat.usage is not None and chat.usage.total_tokens <= length
            with pytest.raises(openai.BadRequestError) as err:
                await sdk.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Say hello"}],
                    max_tokens=length)
            body: Any = err.value.body
            assert (body["code"], body["param"]) == ("context_length_exceeded", "max_tokens")
            assert f"maximum context length is {length} tokens" in body["message"]
    finally:
        for svc in reversed(started):
            await svc.stop()
        await bus.close()
