"""OpenAI's error envelope and the exceptions that carry it across services.

Overload errors (429, 503) may carry `ErrorInfo.retry_after_s`; the gateway sends it as the
`Retry-After` header (`retry_after_header`: whole seconds, rounded up, at least 1).
"""

from __future__ import annotations

import math
from typing import Any

from flotilla.libs.common.messages import ErrorInfo


class FlotillaError(Exception):
    """An error with an HTTP status and OpenAI error fields; raise it anywhere, the gateway
    answers `{"error": {...}}` with `status`."""

    def __init__(self, info: ErrorInfo):
        super().__init__(info.message)
        self.info = info

    @property
    def status(self) -> int:
        return self.info.status


def envelope(info: ErrorInfo) -> dict[str, Any]:
    return {"error": {"message": info.message, "type": info.type, "param": info.param,
                      "code": info.code}}


def invalid_request(message: str, param: str | None = None,
                    code: str | None = None) -> FlotillaError:
    return FlotillaError(ErrorInfo(status=400, type="invalid_request_error", message=message,
                                   param=param, code=code))


def model_not_found(model: str) -> FlotillaError:
    return FlotillaError(ErrorInfo(
        status=404, type="invalid_request_error", param="model", code="model_not_found",
        message=f"The model `{model}` does not exist or is not being served."))


def unavailable(message: str, retry_after_s: float | None = None) -> FlotillaError:
    """503: overload or a missing service; `retry_after_s` becomes the `Retry-After` header."""
    return FlotillaError(ErrorInfo(status=503, type="service_unavailable", message=message,
                                   code="service_unavailable", retry_after_s=retry_after_s))


def deadline_exceeded(message: str = "the request's deadline passed") -> FlotillaError:
    """504: the request's deadline (`TextRequest.deadline`) passed before it was done."""
    return FlotillaError(ErrorInfo(status=504, type="timeout_error", message=message,
                                   code="deadline_exceeded"))


def internal(message: str) -> FlotillaError:
    return FlotillaError(ErrorInfo(status=500, type="server_error", message=message,
                                   code="internal_error"))


def unavailable_retry(message: str, retry_after_s: float,
                      code: str = "service_unavailable") -> FlotillaError:
    """503 that tells the client when to come back (e.g. the gateway is at its in-flight cap)."""
    return FlotillaError(ErrorInfo(status=503, type="service_unavailable", message=message,
                                   code=code, retry_after_s=retry_after_s))


def too_large(message: str, param: str | None = None) -> FlotillaError:
    """413: the request body (or a part of it the server bounds by bytes) is too large."""
    return FlotillaError(ErrorInfo(status=413, type="invalid_request_error", message=message,
                                   param=param, code="request_too_large"))


def retry_after_header(info: ErrorInfo) -> str | None:
    """The `Retry-After` value (integer seconds, rounded up, at least 1) for an error, if any."""
    if info.retry_after_s is None:
        return None
    return str(max(1, math.ceil(info.retry_after_s)))
