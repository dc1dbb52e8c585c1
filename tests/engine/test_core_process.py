"""FLOTILLA_CORE_PROCESS: the engine and its step loop in a child process, behind the same
engine service, through the real tokenizer and gateway services, NATS and SmolLM2 (CPU)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from libs.common import subjects
from libs.common.bus import Bus
from libs.common.errors import FlotillaError
from libs.common.messages import Admission, SamplingOptions, TokenFrame, TokenRequest
from libs.common.model_cache import ensure_default_model
from libs.common.settings import EngineSettings, GatewaySettings, TokenizerSettings
from services.engine.core_process import CoreProcess
from services.engine.service import EngineService
from services.gateway.service import GatewayService
from services.tokenizer.service import TokenizerService
from tests.endpoints import NATS_URL

NATS = NATS_URL
PROMPT = [{"role": "user", "content": "Name three colours."}]


async def _suite(core: bool) -> tuple[list[Any], str]:
    model = f"core-{core}-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = dict(nats_url=NATS, model=str(ensure_default_model()),
                                  served_model_name=model, log_level="WARNING")
    bus = await Bus.connect(NATS, f"core-test-{core}")
    services = [EngineService(EngineSettings(**common, kvcache_mem_mib=256, core_process=core),
                              bus),
                TokenizerService(TokenizerSettings(**common), bus),
                GatewayService(GatewaySettings(nats_url=NATS, port=0, log_level="WARNING",
                                               request_timeout_s=60.0), bus)]
    for svc in services:
        await svc.start()
    async with httpx.AsyncClient(base_url=services[2].url) as http:
        for _ in range(200):
            if any(m["id"] == model for m in (await http.get("/v1/models")).json()["data"]):
                break
            await asyncio.sleep(0.1)
    return services + [bus], model


@pytest.fixture(scope="module")
async def suites() -> AsyncIterator[dict[bool, tuple[list[Any], str]]]:
    out: dict[bool, tuple[list[Any], str]] = {}
    try:
        for core in (True, False):
            out[core] = await _suite(core)
        yield out
    finally:
        for parts, _ in out.values():
            *services, bus = parts
            for svc in reversed(services):
                await svc.stop()
            await bus.close()


def _sdk(parts: list[Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{parts[2].url}/v1", api_key="unused", timeout=300,
                              max_retries=0)


async def test_the_core_process_serves_what_the_in_process_engine_serves(suites) -> None:  # type: ignore[no-untyped-def]
    texts = {}
    for core, (parts, model) in suites.items():
        async with _sdk(parts) as sdk:
            r = await sdk.chat.completions.create(model=model, messages=PROMPT, max_tokens=16,
                                                  temperature=0)
            texts[core] = r.choices[0].message.content
            assert r.usage.completion_tokens == 16
            streamed = ""
            async for chunk in await sdk.chat.completions.create(
                    model=model, messages=PROMPT, max_tokens=16, temperature=0, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    streamed += chunk.choices[0].delta.content
            assert streamed == texts[core]
    assert texts[True] == texts[False] and texts[True]
    engine = suites[True][0][0]
    assert isinstance(engine.loop, CoreProcess) and engine.loop._proc.pid != os.getpid()


async def test_a_grammar_compiles_in_the_core_process(suites) -> None:  # type: ignore[no-untyped-def]
    parts, model = suites[True]
    schema = {"type": "object", "required": ["colour"], "additionalProperties": False,
              "properties": {"colour": {"type": "string", "maxLength": 12}}}
    async with _sdk(parts) as sdk:
        r = await sdk.chat.completions.create(
            model=model, messages=PROMPT, max_tokens=40, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "c", "schema": schema, "strict": True}})
    assert set(json.loads(r.choices[0].message.content)) == {"colour"}


async def test_a_client_that_leaves_frees_the_request_in_the_core(suites) -> None:  # type: ignore[no-untyped-def]
    parts, model = suites[True]
    engine = parts[0]
    async with _sdk(parts) as sdk:
        stream = await sdk.chat.completions.create(model=model, messages=PROMPT,
                                                   max_tokens=400, temperature=0, stream=True)
        async for _ in stream:
            break
        await stream.close()
    for _ in range(100):
        await asyncio.sleep(0.1)
        s = engine.loop.stats()
        if s.get("running") == 0 and s.get("waiting") == 0 and not engine._live:
            break
    assert engine.loop.stats()["running"] == 0 and not engine._live


async def test_bad_requests_are_refused_before_the_core_and_a_dead_core_fails_the_pod() -> None:
    model = f"core-crash-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(NATS, "core-crash-test")
    fatal = asyncio.Event()
    engine = EngineService(EngineSettings(nats_url=NATS, model=str(ensure_default_model()),
                                          served_model_name=model, log_level="WARNING",
                                          kvcache_mem_mib=128, core_process=True),
                           bus, on_fatal=fatal.set)
    await engine.start()
    try:
        def req(ids: list[int], max_tokens: int) -> TokenRequest:
            rid = f"r-{uuid.uuid4().hex[:8]}"
            return TokenRequest(request_id=rid, model=model, prompt_token_ids=ids,
                                sampling=SamplingOptions(max_tokens=max_tokens),
                                stream_subject=subjects.token_stream(rid))

        bad = await bus.request(subjects.engine_generate(model), req([10 ** 9], 4), Admission, 5)
        assert not bad.accepted and bad.error is not None and bad.error.status == 400
        long = req([1, 2, 3], 100_000)
        refused = await bus.request(subjects.engine_generate(model), long, Admission, 5)
        assert refused.error is not None and refused.error.status == 400
        running = req([1, 2, 3], 2_000)
        reader = await bus.open_reader(running.stream_subject, TokenFrame, timeout=30)
        ok = await bus.request(subjects.engine_generate(model), running, Admission, 5)
        assert ok.accepted
        frames = aiter(reader)
        first = await anext(frames)
        assert first.kind == "data"
        assert isinstance(engine.loop, CoreProcess)
        engine.loop._proc.kill()  # the core dies mid-stream
        await asyncio.wait_for(fatal.wait(), 30)
        with pytest.raises(FlotillaError) as err:
            async for _frame in frames:
                pass
        assert err.value.status == 500 and "engine" in str(err.value)
        after = await bus.request(subjects.engine_generate(model), req([1, 2], 4), Admission, 5)
        assert not after.accepted and after.error is not None and after.error.status == 503
        await reader.close()
    finally:
        await engine.stop()
        await bus.close()
