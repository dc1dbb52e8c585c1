"""Anthropic's error envelope on the Messages routes:
`{"type": "error", "error": {"type": ..., "message": ...}}`.

Rules:
- The HTTP status is the one the error carries (400, 404, 429, 503, ...); the error type is
  Anthropic's name for it (`invalid_request_error`, `not_found_error`, `rate_limit_error`,
  `overloaded_error`, `api_error`, ...). A `retry_after_s` becomes a `Retry-After` header.
- `AnthropicRoute` is the route class of the Messages router: whatever a handler raises is
  answered in this envelope (a FlotillaError with its status, anything else as a logged 500),
  so these routes never answer in OpenAI's envelope.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from flotilla.libs.common.errors import FlotillaError, internal
from flotilla.libs.common.messages import ErrorInfo

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_envelope(info: ErrorInfo) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(info.status), "message": info.message}}


def error_response(exc: FlotillaError) -> JSONResponse:
    response = JSONResponse(anthropic_envelope(exc.info), status_code=exc.status)
    if exc.info.retry_after_s is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.info.retry_after_s)))
    return response


class AnthropicRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def in_anthropic_envelope(request: Request) -> Response:
            try:
                return await handler(request)
            except FlotillaError as exc:
                return error_response(exc)
            except Exception as exc:
                log.error("unhandled error on %s %s", request.method, request.url.path,
                          exc_info=exc)
                return error_response(internal(f"internal server error ({type(exc).__name__})"))

        return in_anthropic_envelope
