"""Shared state behind one small interface: Redis when configured, else an in-process dict.

Several gateway replicas share state through Redis (the model registry, counters); a single
gateway with no Redis uses `MemoryStore`, which behaves the same within one process.
"""

from __future__ import annotations

import time
from typing import Protocol


class Store(Protocol):
    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None: ...
    async def get(self, key: str) -> str | None: ...
    async def delete(self, key: str) -> None: ...
    async def incr(self, key: str, amount: int = 1) -> int: ...
    async def scan(self, prefix: str) -> dict[str, str]: ...
    async def close(self) -> None: ...


class MemoryStore:
    """A dict with per-key expiry; the embedded default for a single gateway. Expired keys are
    dropped when read and, every `purge_every` writes, all at once: keys written once and never
    read again (stored responses) must not stay in memory past their TTL."""

    purge_every = 256

    def __init__(self) -> None:
        self._data: dict[str, tuple[str, float | None]] = {}
        self._writes = 0

    def _purge(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, exp) in self._data.items() if exp is not None and exp < now]:
            del self._data[key]

    def _live(self, key: str) -> str | None:
        item = self._data.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and expires < time.monotonic():
            del self._data[key]
            return None
        return value

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        self._data[key] = (value, time.monotonic() + ttl_s if ttl_s else None)
        self._writes += 1
        if self._writes % self.purge_every == 0:
            self._purge()

    async def get(self, key: str) -> str | None:
        return self._live(key)

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def incr(self, key: str, amount: int = 1) -> int:
        value = int(self._live(key) or 0) + amount
        expires = self._data.get(key, ("", None))[1]
        self._data[key] = (str(value), expires)
        return value

    async def scan(self, prefix: str) -> dict[str, str]:
        keys = [k for k in list(self._data) if k.startswith(prefix)]
        return {k: v for k in keys if (v := self._live(k)) is not None}

    async def close(self) -> None:
        self._data.clear()


class RedisStore:
    """The same interface on Redis (redis-py asyncio); keys are namespaced with `flotilla:`."""

    def __init__(self, url: str, namespace: str = "flotilla:"):
        import redis.asyncio as redis

        self._redis = redis.from_url(url, decode_responses=True)
        self._ns = namespace

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        px = int(ttl_s * 1000) if ttl_s else None
        await self._redis.set(self._ns + key, value, px=px)

    async def get(self, key: str) -> str | None:
        value = await self._redis.get(self._ns + key)
        return None if value is None else str(value)

    async def delete(self, key: str) -> None:
        await self._redis.delete(self._ns + key)

    async def incr(self, key: str, amount: int = 1) -> int:
        return int(await self._redis.incrby(self._ns + key, amount))

    async def scan(self, prefix: str) -> dict[str, str]:
        keys = [k async for k in self._redis.scan_iter(match=self._ns + prefix + "*")]
        if not keys:
            return {}
        values = await self._redis.mget(keys)
        return {k[len(self._ns):]: str(v) for k, v in zip(keys, values, strict=True)
                if v is not None}

    async def close(self) -> None:
        await self._redis.aclose()


def make_store(redis_url: str | None) -> Store:
    return RedisStore(redis_url) if redis_url else MemoryStore()
