"""Overload control at the gateway: a bounded number of requests in flight, and deadlines.

Rules:
- `InFlightLimit` (ASGI middleware) counts the requests that cause work on the bus (POST on
  `LIMITED_PATHS`) from their arrival until their response is sent in full: a stream counts
  until it ends. When `max_in_flight` are in flight a new one is answered at once, before its
  body is read, with 503 `overloaded` and `Retry-After` (`overload_retry_after_s`): there is no
  queue. Health, models and the spec are never refused, so a full gateway still says so.
- Any error that carries `retry_after_s` (the tokenizer's or an engine's overload refusals, a
  429 of a per-client limit) gets the same header (http_errors.py).
- Deadline: `request_timeout` is the `X-Request-Timeout` header's seconds (a number >= 1; one
  above `request_deadline_s` is lowered to it; anything else is a 400 naming the header), else
  `request_deadline_s`. The route sets every choice's `TextRequest.deadline` (Unix seconds) so
  the tokenizer and engine abort on their side, and the gateway's own stream readers end the
  response with 504 `deadline_exceeded` (an error event once streaming) and cancel the choices
  when it passes, so no client waits past it whatever the other hops do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from flotilla.libs.common.errors import FlotillaError, invalid_request, unavailable_retry
from flotilla.libs.common.settings import GatewaySettings
from flotilla.services.gateway.http_errors import error_response
from flotilla.services.gateway.metrics import CAUSE_KEY

LIMITED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/tokenize",
                           "/v1/embeddings", "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank"})
TIMEOUT_HEADER = "x-request-timeout"
MIN_TIMEOUT_S = 1.0


class InFlight:
    """The count of limited requests in flight in this gateway process, and its cap."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0
        self.refused = 0  # answered 503 since start


class InFlightLimit:
    """ASGI middleware: see the module rules."""

    def __init__(self, app: ASGIApp, in_flight: InFlight, retry_after_s: float):
        self.app, self.in_flight, self.retry_after_s = app, in_flight, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] not in LIMITED_PATHS):
            await self.app(scope, receive, send)
            return
        state = self.in_flight
        if state.count >= state.limit:
            state.refused += 1
            scope[CAUSE_KEY] = "overloaded"
            refusal = unavailable_retry(
                f"This server is at its limit of {state.limit} requests in flight; try again "
                "shortly.", self.retry_after_s, code="overloaded")
            await error_response(refusal)(scope, receive, send)
            return
        state.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.count -= 1


def request_timeout(headers: Mapping[str, str], settings: GatewaySettings) -> float:
    """Seconds this request may run (see the module rules)."""
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return settings.request_deadline_s
    try:
        value = float(raw.strip())
    except ValueError:
        raise _bad_timeout(raw) from None
    if not math.isfinite(value) or value < MIN_TIMEOUT_S:
        raise _bad_timeout(raw)
    return min(value, settings.request_deadline_s)


def _bad_timeout(raw: str) -> FlotillaError:
    shown = raw if len(raw) <= 40 else raw[:37] + "..."
    return invalid_request(f"Invalid value for header `X-Request-Timeout`: {shown!r}; expected "
                           f"a number of seconds, at least {MIN_TIMEOUT_S:g}.",
                           param="X-Request-Timeout")
