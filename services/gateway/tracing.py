"""The `gateway.request` server span around every HTTP request (streams included, until the last
byte), continuing a caller's W3C trace context when the request carries one. Everything the
request does on the bus runs inside it, so the trace reaches the tokenizer and engine.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flotilla.libs.common import telemetry

SPAN_NAME = "gateway.request"


class TracingMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app
        self.tracer = telemetry.tracer("flotilla.gateway")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = telemetry.extract_context(headers)
        attributes: dict[str, Any] = {
            "http.request.method": scope.get("method", ""),
            "url.path": scope.get("path", ""),
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", ""),
        }
        if headers.get("user-agent"):
            attributes["user_agent.original"] = headers["user-agent"]
        with self.tracer.start_as_current_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER,
                                               attributes=attributes) as span:

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, traced_send)
            route = scope.get("route")
            if route is not None and getattr(route, "path", None):
                span.set_attribute("http.route", route.path)
