"""OpenTelemetry set-up and trace-context propagation through NATS headers."""

from __future__ import annotations

import logging
import sys
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from flotilla.libs.common.settings import CommonSettings

log = logging.getLogger(__name__)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def setup_tracing(service: str, settings: CommonSettings) -> None:
    """Install a tracer provider for this process unless one is already installed (tests install
    an in-memory one before starting services in-process). Without an exporter none is
    installed: OpenTelemetry's API then hands out non-recording spans, which cost next to
    nothing and still pass a caller's trace context on (traceparent in, traceparent out)."""
    if isinstance(trace.get_tracer_provider(), TracerProvider) or settings.otel_exporter == "none":
        return
    provider = TracerProvider(resource=Resource.create({"service.name": f"flotilla-{service}"}))
    if settings.otel_exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    elif settings.otel_exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # optional dependency: pip install 'flotilla[otlp]'
            raise RuntimeError("otel_exporter=otlp needs `pip install flotilla[otlp]`") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otel_endpoint)))
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Current trace context as W3C `traceparent` headers for a NATS message."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_context(headers: dict[str, str] | None) -> Any:
    """An OpenTelemetry context from NATS headers (empty context when none were sent)."""
    return propagate.extract(headers or {})


def attach(ctx: Any) -> object:
    return otel_context.attach(ctx)


def detach(token: object) -> None:
    otel_context.detach(token)  # type: ignore[arg-type]
