"""Hostile input through the real tokenizer: the real gateway (uvicorn) and the real tokenizer
service with SmolLM2's tokenizer on the real NATS server (default max_payload, 1 MiB), a
scripted fake engine behind them. What fits the context is served, what does not gets the
tokenizer's context-length 400 (never a 500, whatever the size), and shapes the spec accepts
are not refused further down."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.settings import GatewaySettings, TokenizerSettings
from flotilla.services.gateway.service import GatewayService
from flotilla.services.tokenizer.service import TokenizerService
from flotilla.services.tokenizer.tokenizer import Tokenizer
from tests.endpoints import NATS_URL
from tests.gateway.schemas import validate_openai
from tests.tokenizer.fake_engine import FakeEngine, Script


@pytest.fixture(scope="module")
async def bus() -> AsyncIterator[Bus]:
    b = await Bus.connect(NATS_URL, "test-hostile")
    yield b
    await b.close()


@pytest.fixture(scope="module")
async def suite(bus: Bus, smollm2_path: Path,
                smollm2: Tokenizer) -> AsyncIterator[tuple[str, str, FakeEngine]]:
    """(gateway URL, model name, fake engine)."""
    name = f"test-hostile-{uuid.uuid4().hex[:8]}"
    common = dict(nats_url=NATS_URL, heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0,
                  request_timeout_s=10.0, discovery_interval_s=0.2, log_level="WARNING")
    # Tokenizing 3 MB takes seconds on a busy CPU: a budget that covers it, so these tests see
    # what the transport delivers (the default 2 s budget is the tokenizer's own question).
    tokenizer = TokenizerService(TokenizerSettings(model=str(smollm2_path),
                                                   served_model_name=name,
                                                   template_timeout_s=60, **common),
                                 bus, tokenizer=smollm2)
    await tokenizer.start()
    engine = FakeEngine(bus, name, Script(chunks=[[28], [29]], finish="length"))
    await engine.start()
    gateway = GatewayService(GatewaySettings(host="127.0.0.1", port=0, redis_url=None,
                                             model_ttl_s=5.0, tools_timeout_s=0.3,
                                             **common), bus)  # type: ignore[arg-type]
    await gateway.start()
    for _ in range(100):
        if await gateway.state.registry.get(name) is not None:
            break
        await asyncio.sleep(0.05)
    yield gateway.url, name, engine
    await gateway.stop()
    await engine.stop()
    await tokenizer.stop()


@pytest.fixture(scope="module")
async def http(suite: tuple[str, str, FakeEngine]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=suite[0], timeout=30) as client:
        yield client


async def _ok_afterwards(http: httpx.AsyncClient, model: str) -> None:
    r = await http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.slow
@pytest.mark.parametrize("endpoint,size", [("completions", 1_200_000), ("chat", 1_200_000),
                                           ("completions", 3_000_000)])
async def test_a_prompt_over_nats_max_payload_gets_the_context_length_400(
        http: httpx.AsyncClient, suite: tuple[str, str, FakeEngine], bus: Bus, endpoint: str,
        size: int) -> None:
    model = suite[1]
    assert bus.nc.max_payload <= 1024 * 1024 + 1  # the request must travel in parts
    text = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[:size]
    if endpoint == "chat":
        r = await http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": text}]})
    else:
        r = await http.post("/v1/completions", json={"model": model, "prompt": text})
    assert r.status_code == 400, r.text[:300]
    validate_openai("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "context_length_exceeded", r.text[:400]
    await _ok_afterwards(http, model)


async def test_token_ids_beyond_the_vocabulary_are_a_400(http: httpx.AsyncClient,
                                                         suite: tuple[str, str, FakeEngine],
                                                         smollm2: Tokenizer) -> None:
    r = await http.post("/v1/completions", json={"model": suite[1],
                                                 "prompt": [1, smollm2.vocab_size]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    await _ok_afterwards(http, suite[1])


async def test_an_empty_assistant_turn_in_history_is_served(
        http: httpx.AsyncClient, suite: tuple[str, str, FakeEngine]) -> None:
    """`content: null` without tool calls is what the spec (and OpenAI) accept."""
    for empty in ({"role": "assistant", "content": None}, {"role": "assistant", "tool_calls": []}):
        r = await http.post("/v1/chat/completions", json={"model": suite[1], "messages": [
            {"role": "user", "content": "Hi"}, empty, {"role": "user", "content": "Again"}],
            "max_tokens": 2})
        assert r.status_code == 200, r.text


async def test_seeds_reach_the_engine_in_its_range(http: httpx.AsyncClient,
                                                   suite: tuple[str, str, FakeEngine]) -> None:
    _, model, engine = suite
    r = await http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2,
                                                  "n": 2, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("cmpl-")
    seeds = sorted((q.request_id, q.sampling.seed) for q in engine.requests
                   if q.request_id.startswith(rid))
    assert [s for _, s in seeds] == [2**63 - 1, 0]
