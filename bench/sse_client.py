"""One streamed chat completion as a client sees it: how it ended and when each token came.

Used by bench/load_test.py and the chaos test (tests/e2e/test_chaos.py). An `Outcome` is one
of:
- finished: `finish_reason` then `data: [DONE]`;
- error_event: an SSE error event then `data: [DONE]` (the stream failed after it started);
- http_error: a status other than 200 before any event (429/503 carry `Retry-After`);
- connection_closed: the connection broke or ended without `[DONE]`;
- hung: no byte for `stall_s` (what must never happen: every fault and every overload ends
  in one of the others within seconds).
A stream that ends with `[DONE]` but neither a finish_reason nor an error is `incomplete`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Kind = Literal["finished", "error_event", "http_error", "connection_closed", "hung",
               "incomplete"]
TERMINAL_ERRORS = ("error_event", "http_error", "connection_closed")


@dataclass
class Outcome:
    kind: Kind
    started: float  # monotonic: when the request was sent
    ended: float
    status: int | None = None
    retry_after: str | None = None
    finish_reason: str | None = None
    detail: str = ""
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.started if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        """Inter-token latencies (s)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def refused(self) -> bool:
        return self.kind == "http_error" and self.status in (429, 503)


def _content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") \
                or choice.get("text"):
            return True
    return False


def _finish(chunk: dict[str, Any]) -> str | None:
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason"):
            return str(choice["finish_reason"])
    return None


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any], stall_s: float,
                      on_token: Callable[[int], None] | None = None) -> Outcome:
    """POST a streaming chat completion and read it to its end (never raises for the
    server's faults: they are outcomes). `on_token(n)` is called after the n-th token."""
    started = time.monotonic()
    times: list[float] = []
    finish: str | None = None
    error = ""
    timeout = httpx.Timeout(stall_s, pool=None)
    try:
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                                 timeout=timeout) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return Outcome("http_error", started, time.monotonic(), r.status_code,
                               r.headers.get("retry-after"), detail=text[:300])
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    kind: Kind = ("error_event" if error else "finished" if finish
                                  else "incomplete")
                    return Outcome(kind, started, time.monotonic(), 200, None, finish, error,
                                   times)
                chunk = json.loads(data)
                if "error" in chunk:
                    error = str(chunk["error"].get("message"))
                    continue
                if _content(chunk):
                    times.append(time.monotonic())
                    if on_token is not None:
                        on_token(len(times))
                finish = _finish(chunk) or finish
    except httpx.TimeoutException as exc:
        return Outcome("hung", started, time.monotonic(), detail=f"no byte for {stall_s:g}s "
                       f"({type(exc).__name__})", token_times=times, finish_reason=finish)
    except httpx.TransportError as exc:
        return Outcome("connection_closed", started, time.monotonic(),
                       detail=f"{type(exc).__name__}: {exc}", token_times=times)
    return Outcome("connection_closed", started, time.monotonic(), 200,
                   detail="the response ended without [DONE]", token_times=times)
