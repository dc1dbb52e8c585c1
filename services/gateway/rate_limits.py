"""Per-key limits: requests per minute, tokens per minute, requests in flight.

Rules:
- Each limit is checked and counted in one atomic step: a Lua script in Redis (every gateway
  replica shares the counts; Redis's own clock, so replicas' clocks do not matter), or the
  same steps on dicts in one process without Redis (`MemoryLimiter`: no await inside a step).
- Minutes are fixed windows that start with a key's first request (or token) after the last
  window ended; `reset_ms` is the time left in the current one, which is also the Retry-After
  of a refusal.
- `admit` (before the body is read) counts the request against `rpm`, takes a lease on one of
  `max_concurrent` slots and refuses a key whose tokens are already spent; it changes nothing
  when it refuses. A lease expires by itself at the request's deadline, so a gateway that dies
  mid-request cannot hold a slot forever.
- `reserve` (once the body is known) takes the request's estimated tokens from `tpm`;
  `finish`, when the request ends, frees its lease and adds the difference to the real count
  if the same window still runs (a new window starts clean), in one step.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

from flotilla.libs.common.store import RedisStore, Store
from flotilla.services.gateway.api_keys import KeyRecord

WINDOW_MS = 60_000
CONCURRENT_RETRY_MS = 1000  # a slot frees when some request ends: no better guess


class Verdict(NamedTuple):
    refused: str  # "" (allowed) | "requests" | "tokens" | "concurrent"
    retry_ms: int
    requests_used: int
    requests_reset_ms: int
    tokens_used: int
    tokens_reset_ms: int
    window: int  # start of the tokens window (ms), for `finish`


_WINDOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local win = tonumber(ARGV[1])
local function window(key)
  local w = redis.call('HMGET', key, 's', 'u')
  local s = tonumber(w[1])
  if s == nil or now - s >= win then return now, 0 end
  return s, tonumber(w[2]) or 0
end
local function count(key, s, u)
  redis.call('HSET', key, 's', s, 'u', u)
  redis.call('PEXPIREAT', key, s + win)
end
"""

ADMIT = _WINDOW + """
local rpm, tpm, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, lease_ms = ARGV[5], tonumber(ARGV[6])
local rs, ru = window(KEYS[1])
local ts, tu = window(KEYS[2])
local running = 0
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  running = redis.call('ZCARD', KEYS[3])
end
local refused, retry = '', 0
if cap > 0 and running >= cap then refused, retry = 'concurrent', tonumber(ARGV[7])
elseif rpm > 0 and ru + 1 > rpm then refused, retry = 'requests', rs + win - now
elseif tpm > 0 and tu >= tpm then refused, retry = 'tokens', ts + win - now end
if refused == '' then
  if rpm > 0 then ru = ru + 1; count(KEYS[1], rs, ru) end
  if cap > 0 then
    redis.call('ZADD', KEYS[3], now + lease_ms, lease)
    if redis.call('PTTL', KEYS[3]) < lease_ms then redis.call('PEXPIRE', KEYS[3], lease_ms) end
  end
end
return {refused, retry, ru, rs + win - now, tu, ts + win - now, ts}
"""

RESERVE = _WINDOW + """
local tpm, cost = tonumber(ARGV[2]), tonumber(ARGV[3])
local ts, tu = window(KEYS[1])
if tpm > 0 and tu + cost > tpm then
  return {'tokens', ts + win - now, 0, 0, tu, ts + win - now, ts}
end
tu = tu + cost
count(KEYS[1], ts, tu)
return {'', 0, 0, 0, tu, ts + win - now, ts}
"""

FINISH = """
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], ARGV[3]) end
local delta = tonumber(ARGV[2])
if delta ~= 0 then
  local w = redis.call('HMGET', KEYS[1], 's', 'u')
  if tonumber(w[1]) == tonumber(ARGV[1]) then
    redis.call('HSET', KEYS[1], 'u', math.max(0, tonumber(w[2]) + delta))
  end
end
return 0
"""


def _keys(record: KeyRecord) -> tuple[str, str, str]:
    base = f"ratelimit:{record.id}:"
    return base + "requests", base + "tokens", base + "running"


class Limiter(Protocol):
    async def admit(self, record: KeyRecord, lease: str, lease_ms: int) -> Verdict: ...
    async def reserve(self, record: KeyRecord, tokens: int) -> Verdict: ...
    async def finish(self, record: KeyRecord, lease: str | None, window: int,
                     delta: int) -> None:
        """Free `lease` (None: the request took none) and add `delta` tokens to the window
        that started at `window`, if it still runs."""


def _verdict(raw: list[object]) -> Verdict:
    refused = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
    return Verdict(refused, *(int(v) for v in raw[1:]))  # type: ignore[call-overload]


class RedisLimiter:
    def __init__(self, store: RedisStore):
        self.store = store

    async def admit(self, record: KeyRecord, lease: str, lease_ms: int) -> Verdict:
        args: list[int | str] = [WINDOW_MS, record.rpm or 0, record.tpm or 0,
                                 record.max_concurrent or 0, lease, lease_ms,
                                 CONCURRENT_RETRY_MS]
        return _verdict(await self.store.run_script(ADMIT, list(_keys(record)), args))

    async def reserve(self, record: KeyRecord, tokens: int) -> Verdict:
        args: list[int | str] = [WINDOW_MS, record.tpm or 0, tokens]
        return _verdict(await self.store.run_script(RESERVE, [_keys(record)[1]], args))

    async def finish(self, record: KeyRecord, lease: str | None, window: int,
                     delta: int) -> None:
        _, tokens, running = _keys(record)
        await self.store.run_script(FINISH, [tokens, running], [window, delta, lease or ""])


class MemoryLimiter:
    """The same steps in one process (a gateway without Redis)."""

    def __init__(self) -> None:
        self._windows: dict[str, tuple[int, int]] = {}  # key -> (start ms, used)
        self._leases: dict[str, dict[str, int]] = {}  # key -> lease -> expiry ms

    def _window(self, key: str, now: int) -> tuple[int, int]:
        start, used = self._windows.get(key, (now, 0))
        return (now, 0) if now - start >= WINDOW_MS else (start, used)

    async def admit(self, record: KeyRecord, lease: str, lease_ms: int) -> Verdict:
        now = int(time.time() * 1000)
        req_key, tok_key, run_key = _keys(record)
        rs, ru = self._window(req_key, now)
        ts, tu = self._window(tok_key, now)
        leases = self._leases.setdefault(run_key, {})
        for name in [n for n, expiry in leases.items() if expiry <= now]:
            del leases[name]
        refused, retry = "", 0
        if record.max_concurrent and len(leases) >= record.max_concurrent:
            refused, retry = "concurrent", CONCURRENT_RETRY_MS
        elif record.rpm and ru + 1 > record.rpm:
            refused, retry = "requests", rs + WINDOW_MS - now
        elif record.tpm and tu >= record.tpm:
            refused, retry = "tokens", ts + WINDOW_MS - now
        if not refused:
            if record.rpm:
                ru += 1
                self._windows[req_key] = (rs, ru)
            if record.max_concurrent:
                leases[lease] = now + lease_ms
        return Verdict(refused, retry, ru, rs + WINDOW_MS - now, tu, ts + WINDOW_MS - now, ts)

    async def reserve(self, record: KeyRecord, tokens: int) -> Verdict:
        now = int(time.time() * 1000)
        key = _keys(record)[1]
        ts, tu = self._window(key, now)
        reset = ts + WINDOW_MS - now
        if record.tpm is not None and tu + tokens > record.tpm:
            return Verdict("tokens", reset, 0, 0, tu, reset, ts)
        self._windows[key] = (ts, tu + tokens)
        return Verdict("", 0, 0, 0, tu + tokens, reset, ts)

    async def finish(self, record: KeyRecord, lease: str | None, window: int,
                     delta: int) -> None:
        _, tokens, running = _keys(record)
        if lease is not None:
            self._leases.get(running, {}).pop(lease, None)
        start, used = self._windows.get(tokens, (-1, 0))
        if delta and start == window:
            self._windows[tokens] = (start, max(0, used + delta))


def make_limiter(store: Store) -> Limiter:
    return RedisLimiter(store) if isinstance(store, RedisStore) else MemoryLimiter()
