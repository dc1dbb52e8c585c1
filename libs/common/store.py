"""Shared state behind one small interface: Redis when configured, else an in-process dict.

Several gateway replicas share state through Redis (the model registry, counters); a single
gateway with no Redis uses `MemoryStore`, which behaves the same within one process.

Rules:
- A store that cannot be reached raises `StoreUnavailable` from every call: a 503 with
  `Retry-After` for whoever asked (never a 500), whose message names the store and the cause
  ("Redis at redis://127.0.0.1:6379/0 unreachable: connection refused").
- An outage is logged once when it starts, then reminded at most every `reminder_s` (with the
  count of failed calls), and once more when the store answers again: a gateway polled every
  few hundred ms must not fill its log with tracebacks. Nothing needs restarting to recover:
  the next call after Redis comes back simply works.
- `ping()` is the readiness check (/ready); `describe()` names the store without secrets.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import ErrorInfo

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreUnavailable(FlotillaError):
    """The shared store cannot be reached: 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(ErrorInfo(status=503, type="service_unavailable", message=message,
                                   code="store_unavailable", retry_after_s=retry_after_s))


class Store(Protocol):
    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None: ...
    async def get(self, key: str) -> str | None: ...
    async def delete(self, key: str) -> None: ...
    async def incr(self, key: str, amount: int = 1) -> int: ...
    async def scan(self, prefix: str) -> dict[str, str]: ...
    async def ping(self) -> None: ...
    def describe(self) -> str: ...
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

    async def ping(self) -> None:
        return None

    def describe(self) -> str:
        return "in-process store"

    async def close(self) -> None:
        self._data.clear()


def redacted(url: str) -> str:
    """The URL without its password (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def cause(exc: BaseException) -> str:
    """A short reason for a failed store call: the OS error's text where there is one
    ("connection refused"), else the exception's own message."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TimeoutError):
            return "timed out"
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno).lower()
        seen = seen.__cause__ or seen.__context__
    return str(exc) or type(exc).__name__


class Outage:
    """Logs a dependency's outage once, with reminders at most every `reminder_s`, and its end."""

    def __init__(self, what: str, reminder_s: float):
        self.what, self.reminder_s = what, reminder_s
        self.since: float | None = None  # monotonic start of the current outage
        self.failures = 0
        self._reminded = 0.0

    def failed(self, reason: str) -> None:
        now = time.monotonic()
        self.failures += 1
        if self.since is None:
            self.since, self._reminded = now, now
            log.error("%s unreachable: %s (calls fail with 503 until it answers again)",
                      self.what, reason)
        elif now - self._reminded >= self.reminder_s:
            self._reminded = now
            log.error("%s still unreachable after %.0fs: %s (%d failed calls)", self.what,
                      now - self.since, reason, self.failures)

    def succeeded(self) -> None:
        if self.since is not None:
            log.warning("%s reachable again after %.1fs", self.what,
                        time.monotonic() - self.since)
            self.since, self.failures = None, 0


class RedisStore:
    """The same interface on Redis (redis-py asyncio); keys are namespaced with `flotilla:`.
    Connects lazily and reconnects on its own; calls fail fast (`timeout_s`) while Redis is
    away."""

    def __init__(self, url: str, namespace: str = "flotilla:", timeout_s: float = 1.0,
                 retry_after_s: float = 2.0, reminder_s: float = 30.0):
        import redis.asyncio as aioredis
        from redis import exceptions

        self._redis = aioredis.from_url(url, decode_responses=True,
                                        socket_connect_timeout=timeout_s,
                                        socket_timeout=timeout_s)
        self._errors = (exceptions.RedisError, OSError)
        self._timeout = exceptions.TimeoutError
        self._ns = namespace
        self._url = redacted(url)
        self._retry_after_s = retry_after_s
        self.outage = Outage(f"Redis at {self._url}", reminder_s)
        self._scripts: dict[str, Any] = {}

    def describe(self) -> str:
        return f"Redis at {self._url}"

    async def _call(self, op: Awaitable[T]) -> T:
        try:
            result = await op
        except self._errors as exc:
            reason = "timed out" if isinstance(exc, self._timeout) else cause(exc)
            self.outage.failed(reason)
            raise StoreUnavailable(f"Redis at {self._url} unreachable: {reason}",
                                   self._retry_after_s) from None
        self.outage.succeeded()
        return result

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        px = int(ttl_s * 1000) if ttl_s else None
        await self._call(self._redis.set(self._ns + key, value, px=px))

    async def get(self, key: str) -> str | None:
        value = await self._call(self._redis.get(self._ns + key))
        return None if value is None else str(value)

    async def delete(self, key: str) -> None:
        await self._call(self._redis.delete(self._ns + key))

    async def incr(self, key: str, amount: int = 1) -> int:
        return int(await self._call(self._redis.incrby(self._ns + key, amount)))

    async def scan(self, prefix: str) -> dict[str, str]:
        return await self._call(self._scan(prefix))

    async def _scan(self, prefix: str) -> dict[str, str]:
        keys = [k async for k in self._redis.scan_iter(match=self._ns + prefix + "*")]
        if not keys:
            return {}
        values = await self._redis.mget(keys)
        return {k[len(self._ns):]: str(v) for k, v in zip(keys, values, strict=True)
                if v is not None}

    async def ping(self) -> None:
        await self._call(self._redis.ping())

    async def run_script(self, script: str, keys: list[str], args: list[int | str]) -> Any:
        """Run a Lua script atomically (EVALSHA, loaded on first use) on namespaced `keys`."""
        runner = self._scripts.get(script)
        if runner is None:
            runner = self._scripts[script] = self._redis.register_script(script)
        return await self._call(runner(keys=[self._ns + k for k in keys], args=args))

    async def close(self) -> None:
        await self._redis.aclose()


def make_store(redis_url: str | None) -> Store:
    return RedisStore(redis_url) if redis_url else MemoryStore()
