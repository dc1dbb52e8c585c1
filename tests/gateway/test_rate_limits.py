"""The per-key limiters step by step: the Lua scripts on the real Redis and the in-process
steps must agree on every count, refusal and reset (services/gateway/rate_limits.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from flotilla.libs.common.store import RedisStore
from flotilla.services.gateway.api_keys import KeyRecord
from flotilla.services.gateway.rate_limits import (
    CONCURRENT_RETRY_MS,
    WINDOW_MS,
    Limiter,
    MemoryLimiter,
    RedisLimiter,
)
from tests.endpoints import REDIS_URL


@pytest.fixture(params=["redis", "memory"])
async def limiter(request: pytest.FixtureRequest) -> AsyncIterator[Limiter]:
    if request.param == "memory":
        yield MemoryLimiter()
        return
    store = RedisStore(REDIS_URL, f"flotilla-test-{uuid.uuid4().hex[:8]}:")
    yield RedisLimiter(store)
    await store.close()


def _key(**limits: int) -> KeyRecord:
    return KeyRecord(id="key_" + uuid.uuid4().hex[:12], **limits)


async def test_requests_per_minute(limiter: Limiter) -> None:
    key = _key(rpm=3)
    for used in (1, 2, 3):
        verdict = await limiter.admit(key, f"l{used}", 60_000)
        assert verdict.refused == "" and verdict.requests_used == used
        assert 0 < verdict.requests_reset_ms <= WINDOW_MS
    for _ in range(2):  # a refusal counts nothing
        verdict = await limiter.admit(key, "l4", 60_000)
        assert verdict.refused == "requests" and verdict.requests_used == 3
        assert 0 < verdict.retry_ms <= WINDOW_MS


async def test_concurrency_leases_are_freed_and_expire(limiter: Limiter) -> None:
    key = _key(max_concurrent=2)
    assert (await limiter.admit(key, "a", 60_000)).refused == ""
    assert (await limiter.admit(key, "b", 100)).refused == ""
    refused = await limiter.admit(key, "c", 60_000)
    assert refused.refused == "concurrent" and refused.retry_ms == CONCURRENT_RETRY_MS
    await limiter.finish(key, "a", -1, 0)
    assert (await limiter.admit(key, "c", 60_000)).refused == ""
    assert (await limiter.admit(key, "d", 60_000)).refused == "concurrent"
    await asyncio.sleep(0.15)  # lease b (100 ms) expired: a dead gateway's slot comes back
    assert (await limiter.admit(key, "d", 60_000)).refused == ""


async def test_tokens_reserved_settled_and_refused(limiter: Limiter) -> None:
    key = _key(tpm=100)
    first = await limiter.reserve(key, 60)
    assert first.refused == "" and first.tokens_used == 60
    over = await limiter.reserve(key, 50)
    assert over.refused == "tokens" and over.tokens_used == 60 and over.retry_ms > 0
    await limiter.finish(key, None, first.window, -50)  # the request used 10
    second = await limiter.reserve(key, 50)
    assert second.refused == "" and second.tokens_used == 60
    await limiter.finish(key, None, second.window, 40)  # it used 90: the key has spent 100
    assert (await limiter.admit(key, "x", 60_000)).refused == "tokens"
    await limiter.finish(key, None, second.window - 1, -100)  # another window's: ignored
    assert (await limiter.reserve(key, 1)).refused == "tokens"


async def test_unlimited_key_counts_nothing(limiter: Limiter) -> None:
    key = _key()
    for i in range(5):
        verdict = await limiter.admit(key, f"l{i}", 60_000)
        assert verdict.refused == "" and verdict.requests_used == 0
    assert (await limiter.reserve(key, 10**6)).refused == ""
