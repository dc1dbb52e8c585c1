"""/metrics of the gateway, tokenizer and engine against what was sent.

The three real services run in this process with the real SmolLM2 model on the test NATS, each
with registries of its own. Streams are sent while /metrics is scraped; afterwards every count,
token total and the TTFT histogram are checked against what the client saw (usage, finish
reasons, its own time to the first content chunk), parsed with prometheus-client's parser.
The module's last test drains the tokenizer and engine (what SIGTERM does) mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.model_cache import ensure_default_model
from flotilla.libs.common.settings import EngineSettings, GatewaySettings, TokenizerSettings
from flotilla.services.engine.service import EngineService
from flotilla.services.gateway.service import GatewayService
from flotilla.services.tokenizer.service import TokenizerService
from tests.endpoints import NATS_URL
from tests.metrics.scrape import Scrape, free_port, scrape

STREAMS = 4
MAX_TOKENS = 6


@dataclass
class Suite:
    gateway: GatewayService
    tokenizer: TokenizerService
    engine: EngineService
    model: str
    engine_url: str
    tokenizer_url: str


@dataclass
class Seen:
    """What the client saw of one stream."""

    ttft_s: float
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@pytest.fixture(scope="module")
async def suite() -> AsyncIterator[Suite]:
    model = f"metrics-{uuid.uuid4().hex[:8]}"
    common = dict(nats_url=NATS_URL, model=str(ensure_default_model()), served_model_name=model,
                  log_level="WARNING")
    engine_port, tokenizer_port = free_port(), free_port()
    bus = await Bus.connect(NATS_URL, "metrics-test")
    services = [EngineService(EngineSettings(**common, kvcache_mem_mib=64,  # type: ignore[arg-type]
                                             metrics_port=engine_port), bus),
                TokenizerService(TokenizerSettings(**common,  # type: ignore[arg-type]
                                                   metrics_port=tokenizer_port), bus),
                GatewayService(GatewaySettings(nats_url=NATS_URL, port=0, max_body_bytes=1024,
                                               log_level="WARNING"), bus)]
    started = []
    try:
        for svc in services:
            await svc.start()
            started.append(svc)
        engine, tokenizer, gateway = services
        assert isinstance(engine, EngineService) and isinstance(tokenizer, TokenizerService)
        assert isinstance(gateway, GatewayService)
        for _ in range(100):
            if await gateway.state.registry.get(model) is not None:
                break
            await asyncio.sleep(0.05)
        yield Suite(gateway, tokenizer, engine, model, f"http://127.0.0.1:{engine_port}/metrics",
                    f"http://127.0.0.1:{tokenizer_port}/metrics")
    finally:
        for svc in reversed(started):
            await svc.stop()
        await bus.close()


async def _stream(http: httpx.AsyncClient, model: str, content: str,
                  max_tokens: int = MAX_TOKENS) -> Seen:
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    ttft, finish, usage = None, None, None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                if ttft is None and choice["delta"].get("content"):  # not the role chunk
                    ttft = time.monotonic() - start
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    assert ttft is not None and finish is not None and usage is not None
    return Seen(ttft, finish, usage["prompt_tokens"], usage["completion_tokens"])


async def test_metrics_match_what_was_sent(suite: Suite) -> None:
    gw_url = f"{suite.gateway.url}/metrics"
    async with httpx.AsyncClient(base_url=suite.gateway.url, timeout=120) as http:
        before = await scrape(gw_url)
        work = [asyncio.ensure_future(_stream(http, suite.model, f"Count to {i + 3}."))
                for i in range(STREAMS)]
        during: list[Scrape] = []
        while not all(w.done() for w in work):  # scrapes while the streams run
            during.append(await scrape(gw_url))
            await asyncio.sleep(0.05)
        seen = [await w for w in work]
        big = await http.post("/v1/chat/completions", content=b"{" + b" " * 2000 + b"}",
                              headers={"content-type": "application/json"})
        assert big.status_code == 413

    gw, engine, tok = (await scrape(gw_url), await scrape(suite.engine_url),
                       await scrape(suite.tokenizer_url))
    model = {"model_name": suite.model}
    chat = {"endpoint": "/v1/chat/completions", "method": "POST"}
    assert before.value("flotilla:http_requests_total", **chat, status="200") == 0
    assert gw.value("flotilla:http_requests_total", **chat, status="200") == STREAMS
    assert gw.value("flotilla:http_requests_total", **chat, status="413") == 1
    assert gw.value("flotilla:request_rejections_total", service="gateway",
                    cause="too_large") == 1
    assert max(s.value("flotilla:http_requests_in_flight") for s in during) >= 1
    assert gw.value("flotilla:http_requests_in_flight") == 0

    reasons = Counter(s.finish_reason for s in seen)
    for reason, count in reasons.items():
        assert gw.value("flotilla:request_success_total", **model,
                        finished_reason=reason) == count
    prompt = sum(s.prompt_tokens for s in seen)
    generated = sum(s.completion_tokens for s in seen)
    assert gw.value("flotilla:request_prompt_tokens_sum", **model) == prompt
    assert gw.value("flotilla:request_generation_tokens_sum", **model) == generated
    assert gw.value("flotilla:request_prompt_tokens_count", **model) == STREAMS
    assert engine.value("flotilla:prompt_tokens_total", **model) == prompt
    assert engine.value("flotilla:generation_tokens_total", **model) == generated

    # TTFT: one observation per stream, each at most the client's own measurement
    client = sorted(s.ttft_s for s in seen)
    assert gw.value("flotilla:time_to_first_token_seconds_count", **model) == STREAMS
    server_sum = gw.value("flotilla:time_to_first_token_seconds_sum", **model)
    assert sum(client) - 0.5 * STREAMS <= server_sum <= sum(client)
    buckets = gw.buckets("flotilla:time_to_first_token_seconds", **model)
    assert min(n for le, n in buckets.items() if le >= client[-1]) == STREAMS
    e2e = gw.value("flotilla:e2e_request_latency_seconds_sum", **model)
    assert e2e >= server_sum
    assert gw.value("flotilla:inter_token_latency_seconds_count", **model) >= 1
    assert gw.value("flotilla:hop_latency_seconds_count", hop="gateway_tokenizer",
                    **model) == STREAMS

    assert tok.value("flotilla:hop_latency_seconds_count", hop="tokenizer_engine",
                     **model) == STREAMS
    assert engine.value("flotilla:request_queue_time_seconds_count", **model) == STREAMS
    assert engine.value("flotilla:engine_step_seconds_count", **model) >= MAX_TOKENS
    assert engine.value("flotilla:num_requests_running", **model) == 0
    assert 0 <= engine.value("flotilla:kv_cache_usage_perc", **model) <= 1
    assert engine.value("flotilla:prefix_cache_queries_total", **model) >= prompt
    assert engine.value("flotilla:engine_requests_finished_total", **model,
                        outcome="finished") == STREAMS
    assert "process_cpu_seconds_total" in engine.names()


async def test_tokenizer_and_engine_drain_finishes_the_stream_in_flight(suite: Suite) -> None:
    """Last in the module: it drains the module's tokenizer and engine."""
    async with httpx.AsyncClient(base_url=suite.gateway.url, timeout=120) as http:
        running = asyncio.ensure_future(_stream(http, suite.model, "Count to fifty.", 24))
        for _ in range(200):  # until the engine runs it
            engine = await scrape(suite.engine_url)
            if engine.value("flotilla:num_requests_running", model_name=suite.model) == 1:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the stream never reached the engine")
        started = time.monotonic()
        drains = asyncio.ensure_future(asyncio.gather(suite.tokenizer.drain(30),
                                                      suite.engine.drain(30)))
        await asyncio.sleep(0.1)
        refused = await http.post("/v1/chat/completions", json={
            "model": suite.model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        ready = await http.get("/ready")
        assert ready.status_code == 503
        assert any("draining" in reason for reason in ready.json()["reasons"]), ready.json()
        assert not drains.done()  # the drains wait for the stream
        seen = await running
        await asyncio.wait_for(drains, 5)
    assert seen.completion_tokens == 24 or seen.finish_reason == "stop"
    assert time.monotonic() - started < 30
