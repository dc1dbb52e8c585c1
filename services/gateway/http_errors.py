"""Every HTTP error in OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`.

Rules: FlotillaError answers its own status; unknown routes and methods answer 404 / 405 in the
envelope; FastAPI's 422 never appears (request validation failures are 400); anything else is a
bug and answers 500 with the envelope, logged with its traceback. An error whose ErrorInfo
carries `retry_after_s` (overload: 429 / 503 from the gateway, the tokenizer or an engine)
answers with a `Retry-After` header in whole seconds, rounded up.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flotilla.libs.common.errors import (
    FlotillaError,
    envelope,
    internal,
    invalid_request,
    retry_after_header,
)
from flotilla.libs.common.messages import ErrorInfo
from flotilla.services.gateway.validation import param_path

log = logging.getLogger(__name__)


def error_response(exc: FlotillaError) -> JSONResponse:
    retry_after = retry_after_header(exc.info)
    return JSONResponse(envelope(exc.info), status_code=exc.status,
                        headers={"Retry-After": retry_after} if retry_after else None)


async def _flotilla(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FlotillaError)
    return error_response(exc)


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message, code = f"Unknown URL: {request.method} {request.url.path}", "not_found"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    info = ErrorInfo(status=exc.status_code, type="invalid_request_error", message=message,
                     code=code)
    response = error_response(FlotillaError(info))
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [p for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = param_path(loc)
    return error_response(invalid_request(f"Invalid value for `{param}`: {first.get('msg')}",
                                          param=param))


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(internal(f"internal server error ({type(exc).__name__})"))


def install(app: FastAPI) -> None:
    app.add_exception_handler(FlotillaError, _flotilla)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(Exception, _bug)
