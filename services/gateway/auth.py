"""API-key authentication and per-key admission: the `ApiKeyAuth` ASGI middleware.

Rules:
- Off (every request passes, today's behaviour) unless the gateway has a key in its settings
  or `require_api_key` (api_keys.py).
- The key comes from `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's SDK). No
  key, or one not found (wrong, revoked), is 401 before the body is read: in Anthropic's
  envelope (`authentication_error`) on /v1/messages routes, OpenAI's elsewhere
  (`invalid_api_key`). Open without a key: `auth_open_paths` (health, readiness, metrics by
  default) and GET / and /ui/* (the chat UI's page, which then sends the key it is given).
- Every authenticated POST is admitted by the key's limits (rate_limits.py) before its body is
  read: 429 with Retry-After and the x-ratelimit-* headers when refused (in the route's
  envelope). Every response to a keyed request carries the x-ratelimit-* headers of the key's
  limits (key_usage.py).
- When the response has ended (sent in full, the client gone, or failed), the request's
  concurrency slot is released and its tokens settled, whatever happened.
- `on_rate_limited(record, kind)` is called for every 429 this middleware or a token
  reservation answers: the metrics helper's counter of rate-limit hits by key goes there.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import ErrorInfo
from flotilla.libs.common.settings import GatewaySettings
from flotilla.services.gateway import http_errors
from flotilla.services.gateway.anthropic import errors as anthropic_errors
from flotilla.services.gateway.api_keys import KeyRecord, KeyRing
from flotilla.services.gateway.key_usage import CURRENT, KeyUsage, duration, rate_limited
from flotilla.services.gateway.rate_limits import Limiter

log = logging.getLogger(__name__)
LEASE_SLACK_S = 5.0  # a slot outlives the longest request by this much before it expires


def unauthorized(message: str) -> FlotillaError:
    return FlotillaError(ErrorInfo(status=401, type="invalid_request_error",
                                   code="invalid_api_key", message=message))


NO_KEY = ("You didn't provide an API key. Send it in an `Authorization: Bearer YOUR_KEY` "
          "header (or as `x-api-key`).")
WRONG_KEY = "Incorrect API key provided."


def request_key(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None


class ApiKeyAuth:
    """ASGI middleware: see the module rules."""

    def __init__(self, app: ASGIApp, keys: KeyRing, limiter: Limiter,
                 settings: GatewaySettings,
                 on_rate_limited: Callable[[KeyRecord, str], None] | None = None):
        self.app, self.keys, self.limiter = app, keys, limiter
        self.open_paths = frozenset(p.strip() for p in settings.auth_open_paths.split(",")
                                    if p.strip())
        self.lease_ms = int((settings.request_deadline_s + LEASE_SLACK_S) * 1000)
        self.on_rate_limited = on_rate_limited or (lambda record, kind: None)

    def _open(self, scope: Scope) -> bool:
        path = scope["path"]
        if path in self.open_paths:
            return True
        return scope["method"] in ("GET", "HEAD") and (path == "/" or path.startswith("/ui/"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.required or self._open(scope):
            await self.app(scope, receive, send)
            return
        anthropic = scope["path"].startswith("/v1/messages")
        respond = anthropic_errors.error_response if anthropic else http_errors.error_response
        key = request_key(scope)
        usage: KeyUsage | None = None
        try:
            record = await self.keys.lookup(key) if key is not None else None
            if record is None:
                raise unauthorized(WRONG_KEY if key is not None else NO_KEY)
            usage = KeyUsage(record, self.limiter, secrets.token_hex(8))
            if scope["method"] == "POST":
                await self._admit(usage)
        except FlotillaError as exc:
            response = respond(exc)
            if exc.status == 429 and usage is not None:
                self.on_rate_limited(usage.record, exc.info.type)
                response.raw_headers.extend(usage.headers())
            await response(scope, receive, send)
            return
        assert usage is not None
        keyed = usage

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                if message["status"] == 429 and keyed.tokens and keyed.tokens.refused:
                    self.on_rate_limited(keyed.record, "tokens")
                message["headers"] = [*message.get("headers", []), *keyed.headers()]
            await send(message)

        token = CURRENT.set(usage)
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            CURRENT.reset(token)
            try:
                await usage.settle()
            except FlotillaError as exc:  # the store is away: its counts expire on their own
                log.warning("cannot settle the limits of key %s: %s", usage.record.id, exc)

    async def _admit(self, usage: KeyUsage) -> None:
        record = usage.record
        verdict = await self.limiter.admit(record, usage.lease, self.lease_ms)
        usage.admission = verdict
        if verdict.refused == "concurrent":
            raise rate_limited("requests", f"Too many requests in flight for this key: limit "
                               f"{record.max_concurrent}. Please try again shortly.",
                               verdict.retry_ms)
        if verdict.refused == "requests":
            raise rate_limited("requests", f"Rate limit reached for requests per minute (RPM): "
                               f"Limit {record.rpm}, Used {verdict.requests_used}, Requested 1. "
                               f"Please try again in {duration(verdict.retry_ms)}.",
                               verdict.retry_ms)
        if verdict.refused == "tokens":
            raise rate_limited("tokens", f"Rate limit reached for tokens per minute (TPM): "
                               f"Limit {record.tpm}, Used {verdict.tokens_used}. Please try "
                               f"again in {duration(verdict.retry_ms)}.", verdict.retry_ms)
