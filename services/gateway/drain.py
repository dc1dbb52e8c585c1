"""Graceful drain of one gateway process (SIGTERM: libs/common/service.py `run_forever`).

Rules:
- `DrainGate` (ASGI middleware) counts the HTTP requests being answered (a stream until its
  last byte). Once `Drain.begin()` is called, every new request except the probes (`/health`,
  `/ready`, `/metrics`) is answered at once with 503 `draining` and `Retry-After`, and /ready
  says not ready (health.py), so a load balancer moves away while the requests in flight
  finish.
- `Drain.wait(timeout_s)` returns True when the last request in flight has ended, False when
  the timeout passed first (the owner then stops the server, which cuts what is left).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

from flotilla.libs.common.errors import unavailable_retry
from flotilla.services.gateway.http_errors import error_response
from flotilla.services.gateway.metrics import CAUSE_KEY

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


class Drain:
    """Whether this process is draining, and the requests it still answers."""

    def __init__(self, retry_after_s: float):
        self.retry_after_s = retry_after_s
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.draining = True

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class DrainGate:
    """ASGI middleware: see the module rules."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        drain = self.drain
        if drain.draining:
            scope[CAUSE_KEY] = "draining"
            refusal = unavailable_retry("This server is shutting down; retry on another "
                                        "instance.", drain.retry_after_s, code="draining")
            await error_response(refusal)(scope, receive, send)
            return
        drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            drain.leave()
