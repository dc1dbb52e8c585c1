"""API keys and per-key limits, on two real gateways sharing the real Redis (and one without).

The OpenAI and Anthropic SDKs are the references for the envelopes and headers: they raise
AuthenticationError for a 401 and RateLimitError for a 429 from the status and body they read.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis.asyncio as aioredis

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.store import RedisStore
from flotilla.services.gateway.api_keys import create_key, key_hash, revoke_key
from flotilla.services.gateway.service import GatewayService
from flotilla.services.launcher.nats_server import free_port
from tests.endpoints import NATS_URL, REDIS_URL
from tests.gateway.conftest import chat, gateway_settings
from tests.gateway.fakes import FakeTokenizer
from tests.metrics.scrape import Scrape

FAKE_TOKENS = 7 + 3  # the fake tokenizer's usage of one choice: prompt + completion


@pytest.fixture(scope="module")
async def namespace() -> str:
    return f"flotilla-test-{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
async def store(namespace: str) -> AsyncIterator[RedisStore]:
    s = RedisStore(REDIS_URL, namespace)
    yield s
    raw = aioredis.from_url(REDIS_URL)
    keys = [k async for k in raw.scan_iter(match=namespace + "*")]
    if keys:
        await raw.delete(*keys)
    await raw.aclose()
    await s.close()


async def _gateway(bus: Bus, tokenizer: FakeTokenizer, namespace: str,
                   **settings: Any) -> GatewayService:
    service = GatewayService(gateway_settings(**settings), bus,
                             store=RedisStore(REDIS_URL, namespace) if namespace else None)
    await service.start()
    for _ in range(100):
        if await service.state.registry.get(tokenizer.model) is not None:
            break
        await asyncio.sleep(0.05)
    return service


@pytest.fixture(scope="module")
async def pair(bus: Bus, tokenizer: FakeTokenizer,
               namespace: str) -> AsyncIterator[tuple[GatewayService, GatewayService]]:
    """Two gateway replicas sharing one Redis, keys required."""
    first = await _gateway(bus, tokenizer, namespace, require_api_key=True, ui=True)
    second = await _gateway(bus, tokenizer, namespace, require_api_key=True)
    yield first, second
    await first.stop()
    await second.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_no_wrong_or_revoked_key_is_401_in_both_envelopes(
        pair: tuple[GatewayService, GatewayService], store: RedisStore, model: str) -> None:
    gw = pair[0]
    key, record = await create_key(store, name="short-lived")
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        ok = await client.post("/v1/chat/completions", json=chat(model, "quick"),
                               headers=_auth(key))
        assert ok.status_code == 200, ok.text
        msg = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "quick"}]}
        assert (await client.post("/v1/messages", json=msg,
                                  headers={"x-api-key": key})).status_code == 200
        assert await revoke_key(store, record.id)
        for headers in ({}, _auth("flt-wrong"), _auth(key), {"x-api-key": key}):
            r = await client.post("/v1/chat/completions", json=chat(model, "quick"),
                                  headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            r = await client.post("/v1/messages", json=msg, headers=headers)
            assert r.status_code == 401
            assert r.json() == {"type": "error", "error": {
                "type": "authentication_error", "message": r.json()["error"]["message"]}}
        assert (await client.get("/v1/models")).status_code == 401
        # open without a key: health, readiness, and the chat UI's page and files
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/ready")).status_code in (200, 503)
        assert (await client.get("/")).status_code == 200


async def test_sdks_work_with_a_key_and_raise_on_a_wrong_one(
        pair: tuple[GatewayService, GatewayService], store: RedisStore, model: str) -> None:
    gw = pair[0]
    key, _ = await create_key(store, name="sdk")
    good = openai.AsyncOpenAI(api_key=key, base_url=gw.url + "/v1", max_retries=0)
    reply = await good.chat.completions.create(model=model,
                                               messages=[{"role": "user", "content": "quick"}])
    assert reply.choices[0].message.content == "ok"
    bad = openai.AsyncOpenAI(api_key="flt-nope", base_url=gw.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.chat.completions.create(model=model,
                                          messages=[{"role": "user", "content": "quick"}])
    claude = anthropic.AsyncAnthropic(api_key=key, base_url=gw.url, max_retries=0)
    message = await claude.messages.create(model=model, max_tokens=8,
                                           messages=[{"role": "user", "content": "quick"}])
    assert message.content[0].text == "ok"  # type: ignore[union-attr]
    wrong = anthropic.AsyncAnthropic(api_key="flt-nope", base_url=gw.url, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        await wrong.messages.create(model=model, max_tokens=8,
                                    messages=[{"role": "user", "content": "quick"}])
    await good.close(), await bad.close(), await claude.close(), await wrong.close()


async def test_eleventh_request_of_a_10_rpm_key_is_429_across_two_gateways(
        pair: tuple[GatewayService, GatewayService], store: RedisStore, model: str) -> None:
    key, record = await create_key(store, rpm=10)
    clients = [httpx.AsyncClient(base_url=gw.url, timeout=10, headers=_auth(key))
               for gw in pair]
    try:
        for i in range(10):
            r = await clients[i % 2].post("/v1/chat/completions", json=chat(model, "quick"))
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "10"
            assert r.headers["x-ratelimit-remaining-requests"] == str(9 - i)
            assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        r = await clients[0].post("/v1/chat/completions", json=chat(model, "quick"))
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.json()["error"]["type"] == "requests"
        assert r.headers["x-ratelimit-limit-requests"] == "10"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        msg = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        r = await clients[1].post("/v1/messages", json=msg)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert r.headers["x-ratelimit-remaining-requests"] == "0" and "Retry-After" in r.headers
        sdk = openai.AsyncOpenAI(api_key=key, base_url=pair[1].url + "/v1", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            await sdk.chat.completions.create(model=model,
                                              messages=[{"role": "user", "content": "quick"}])
        await sdk.close()
        for client, hits in zip(clients, (1, 2), strict=True):  # /metrics is open without a key
            scrape = Scrape((await client.get("/metrics", headers={"authorization": ""})).text)
            assert scrape.value("flotilla:rate_limit_hits_total", key=record.id,
                                limit="requests") == hits
    finally:
        for c in clients:
            await c.aclose()


async def test_tokens_are_reserved_then_settled_and_limited_across_gateways(
        pair: tuple[GatewayService, GatewayService], store: RedisStore, model: str,
        namespace: str) -> None:
    key, record = await create_key(store, tpm=300)
    raw = aioredis.from_url(REDIS_URL, decode_responses=True)
    tokens_key = f"{namespace}ratelimit:{record.id}:tokens"
    clients = [httpx.AsyncClient(base_url=gw.url, timeout=10, headers=_auth(key))
               for gw in pair]
    try:
        body = chat(model, "quick", max_tokens=50)
        r = await clients[0].post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        reserved = 300 - int(r.headers["x-ratelimit-remaining-tokens"])
        assert reserved >= 50  # the output's 50 plus the prompt's estimate
        assert r.headers["x-ratelimit-limit-tokens"] == "300"
        assert int(await raw.hget(tokens_key, "u")) == FAKE_TOKENS  # settled to the real count
        used = FAKE_TOKENS
        for i in range(1, 40):  # each reserves `reserved`, then settles to FAKE_TOKENS
            r = await clients[i % 2].post("/v1/chat/completions", json=body)
            if r.status_code == 429:
                break
            assert r.status_code == 200, r.text
            used += FAKE_TOKENS
        assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
        assert used + reserved > 300 >= used  # refused exactly when the reservation won't fit
        assert r.headers["x-ratelimit-remaining-tokens"] == str(300 - used)
        assert int(r.headers["Retry-After"]) >= 1
        too_big = await clients[1].post("/v1/chat/completions",
                                        json=chat(model, "quick", max_tokens=5000))
        assert too_big.status_code == 429 and "larger than the limit" in too_big.text
    finally:
        for c in clients:
            await c.aclose()
        await raw.aclose()


async def test_concurrency_cap_and_a_disconnected_stream_settles(
        pair: tuple[GatewayService, GatewayService], store: RedisStore, model: str,
        namespace: str) -> None:
    key, record = await create_key(store, max_concurrent=1, tpm=100_000)
    raw = aioredis.from_url(REDIS_URL, decode_responses=True)
    running = f"{namespace}ratelimit:{record.id}:running"
    tokens = f"{namespace}ratelimit:{record.id}:tokens"
    a = httpx.AsyncClient(base_url=pair[0].url, timeout=10, headers=_auth(key))
    b = httpx.AsyncClient(base_url=pair[1].url, timeout=10, headers=_auth(key))
    try:
        async with a.stream("POST", "/v1/chat/completions",
                            json=chat(model, "slow", stream=True, max_tokens=100)) as stream:
            assert stream.status_code == 200
            reserved = 100_000 - int(stream.headers["x-ratelimit-remaining-tokens"])
            lines = stream.aiter_lines()
            await anext(lines)
            assert await raw.zcard(running) == 1
            refused = await b.post("/v1/chat/completions", json=chat(model, "quick"))
            assert refused.status_code == 429, refused.text
            assert "in flight" in refused.json()["error"]["message"]
        # the client left mid-stream: its slot is freed and it keeps its reservation
        for _ in range(50):
            if await raw.zcard(running) == 0:
                break
            await asyncio.sleep(0.05)
        assert await raw.zcard(running) == 0
        assert int(await raw.hget(tokens, "u")) >= reserved
        ok = await b.post("/v1/chat/completions", json=chat(model, "quick"))
        assert ok.status_code == 200, ok.text
    finally:
        await a.aclose(), await b.aclose(), await raw.aclose()


async def test_model_allowlist(pair: tuple[GatewayService, GatewayService], store: RedisStore,
                               model: str) -> None:
    allowed, _ = await create_key(store, models=[model])
    other, _ = await create_key(store, models=["some-other-model"])
    async with httpx.AsyncClient(base_url=pair[1].url, timeout=10) as client:
        ok = await client.post("/v1/chat/completions", json=chat(model, "quick"),
                               headers=_auth(allowed))
        assert ok.status_code == 200
        no = await client.post("/v1/chat/completions", json=chat(model, "quick"),
                               headers=_auth(other))
        assert no.status_code == 404 and no.json()["error"]["code"] == "model_not_found"
        listed = await client.get("/v1/models", headers=_auth(other))
        assert model not in [m["id"] for m in listed.json()["data"]]
        listed = await client.get("/v1/models", headers=_auth(allowed))
        assert model in [m["id"] for m in listed.json()["data"]]
        one = await client.get(f"/v1/models/{model}", headers=_auth(other))
        assert one.status_code == 404
        msg = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        no = await client.post("/v1/messages", json=msg, headers={"x-api-key": other})
        assert no.status_code == 404 and no.json()["error"]["type"] == "not_found_error"


async def test_keys_cannot_be_read_back_from_redis(
        pair: tuple[GatewayService, GatewayService], store: RedisStore, model: str) -> None:
    keys = [(await create_key(store, name=f"k{i}", rpm=100, tpm=10_000,
                              max_concurrent=4))[0] for i in range(3)]
    async with httpx.AsyncClient(base_url=pair[0].url, timeout=10) as client:
        for key in keys:  # leave rate-limit state behind too
            r = await client.post("/v1/chat/completions", json=chat(model, "quick"),
                                  headers=_auth(key))
            assert r.status_code == 200
    raw = aioredis.from_url(REDIS_URL)
    dump = []
    async for name in raw.scan_iter(count=1000):
        dump.append(name)
        kind = (await raw.type(name)).decode()
        if kind == "string":
            dump.append(await raw.get(name) or b"")
        elif kind == "hash":
            dump += [v for kv in (await raw.hgetall(name)).items() for v in kv]
        elif kind == "zset":
            dump += await raw.zrange(name, 0, -1)
    await raw.aclose()
    blob = b"\n".join(dump)
    for key in keys:
        assert key.encode() not in blob
        assert key[4:].encode() not in blob  # nor the key without its prefix
        assert key_hash(key).encode() in blob  # only its hash is there


async def test_keys_from_settings_without_redis(bus: Bus, tokenizer: FakeTokenizer,
                                                model: str) -> None:
    gw = await _gateway(bus, tokenizer, "", api_keys="alpha, beta", key_rpm=2,
                        auth_open_paths="/health")
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            assert (await client.get("/ready")).status_code == 401  # not open any more
            assert (await client.get("/health")).status_code == 200
            for key in ("alpha", "beta"):
                r = await client.post("/v1/completions", headers=_auth(key),
                                      json={"model": model, "prompt": "quick"})
                assert r.status_code == 200, r.text
                assert r.headers["x-ratelimit-remaining-requests"] == "1"
            assert (await client.post("/v1/completions", headers=_auth("gamma"),
                                      json={"model": model, "prompt": "quick"})).status_code == 401
            await client.post("/v1/completions", headers=_auth("alpha"),
                              json={"model": model, "prompt": "quick"})
            r = await client.post("/v1/completions", headers=_auth("alpha"),
                                  json={"model": model, "prompt": "quick"})
            assert r.status_code == 429
    finally:
        await gw.stop()


async def test_auth_off_without_keys_and_cors_off_by_default(
        bus: Bus, tokenizer: FakeTokenizer, model: str) -> None:
    plain = await _gateway(bus, tokenizer, "")
    cors = await _gateway(bus, tokenizer, "", cors_origins="https://app.example")
    try:
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(plain.url + "/v1/chat/completions", json=chat(model, "quick"),
                                  headers={"Origin": "https://app.example"})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
            r = await client.options(plain.url + "/v1/chat/completions", headers=preflight)
            assert "access-control-allow-origin" not in r.headers
            r = await client.options(cors.url + "/v1/chat/completions", headers=preflight)
            assert r.headers["access-control-allow-origin"] == "https://app.example"
            r = await client.options(cors.url + "/v1/chat/completions",
                                     headers={**preflight, "Origin": "https://evil.example"})
            assert "access-control-allow-origin" not in r.headers
    finally:
        await plain.stop()
        await cors.stop()


async def test_ten_rpm_across_two_gateway_processes(tokenizer: FakeTokenizer, store: RedisStore,
                                                    model: str) -> None:
    """As deployed: two `python -m flotilla.services.gateway` processes, one Redis (the keys and
    counts live in the Redis namespace every gateway uses)."""
    plain = RedisStore(REDIS_URL)  # the default `flotilla:` namespace the processes use
    key, record = await create_key(plain, rpm=10)
    ports = [free_port(), free_port()]
    env = dict(os.environ, FLOTILLA_NATS_URL=NATS_URL, FLOTILLA_REDIS_URL=REDIS_URL,
               FLOTILLA_REQUIRE_API_KEY="1", FLOTILLA_HOST="127.0.0.1",
               FLOTILLA_LOG_LEVEL="WARNING", FLOTILLA_DISCOVERY_INTERVAL_S="0.5",
               FLOTILLA_OTEL_EXPORTER="none")
    procs = [subprocess.Popen([sys.executable, "-m", "flotilla.services.gateway"],
                              env={**env, "FLOTILLA_PORT": str(port)}) for port in ports]
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10,
                                 headers=_auth(key)) for port in ports]
    try:
        for client in clients:  # up, and following the fake tokenizer's model
            for _ in range(200):
                try:
                    if model in (await client.get("/v1/models")).text:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.05)
        statuses = []
        for i in range(11):
            r = await clients[i % 2].post("/v1/completions",
                                          json={"model": model, "prompt": "quick"})
            statuses.append(r.status_code)
        assert statuses == [200] * 10 + [429]
        assert r.headers["x-ratelimit-limit-requests"] == "10"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert "Retry-After" in r.headers
    finally:
        for client in clients:
            await client.aclose()
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        await revoke_key(plain, record.id)
        await plain.close()
