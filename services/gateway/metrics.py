"""The gateway's Prometheus metrics, `GET /metrics`, and the middleware that counts requests.

Rules:
- `GatewayMetrics` owns every gateway metric (docs/metrics.md). One instance per app, on
  `GatewayState.metrics`; with several worker processes (`multiproc_dir` set) /metrics sums
  every worker's files, so whichever worker answers a scrape shows the whole gateway.
- `MetricsMiddleware` counts every HTTP request once its response has started, labelled by the
  route's path template (unknown paths are `other`: a label never takes a client's text) and
  status; a refusal (413, 429, 503, 504) also counts in `request_rejections_total` by cause.
  Whoever refuses with a cause of its own (the in-flight cap, the drain) names it in
  `scope[CAUSE_KEY]`.
- Per-choice timings come from the stream reader (`ChoiceTimer`, services/gateway/streams.py):
  TTFT and end-to-end from when the request's streams were created, inter-token latency between
  successive data frames of a choice, the gateway→tokenizer hop as the admission round trip.
- `rate_limit_hit(key, limit)` is the hook the per-key limits (auth.py) call on every 429.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import NamedTuple

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flotilla.libs.common.messages import TextFinal
from flotilla.libs.common.metrics import (
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    multiprocess_registry,
    name,
    service_registry,
)

CAUSE_KEY = "flotilla.refusal_cause"
CAUSES = {413: "too_large", 429: "rate_limited", 503: "unavailable", 504: "deadline"}
UNTRACKED_PATHS = frozenset({"/metrics"})

router = APIRouter()


class GatewayMetrics:
    def __init__(self, multiproc_dir: Path | None = None):
        self.multiproc_dir = multiproc_dir
        self.registry = service_registry() if multiproc_dir is None else None
        r = self.registry
        model = ["model_name"]
        self.http_requests = Counter(
            name("http_requests"), "HTTP requests answered, by route, method and status",
            ["endpoint", "method", "status"], registry=r)
        self.in_flight = Gauge(
            name("http_requests_in_flight"), "HTTP requests being answered (streams until "
            "their last byte)", registry=r, multiprocess_mode="livesum")
        self.rejections = Counter(
            name("request_rejections"), "Requests refused, by the service that refused and "
            "why (too_large 413, rate_limited 429, overloaded / draining / unavailable 503, "
            "deadline 504)", ["service", "cause"], registry=r)
        self.rate_limit_hits = Counter(
            name("rate_limit_hits"), "429s sent by the per-key limits, by key id and the limit "
            "hit (requests or tokens)", ["key", "limit"], registry=r)
        self.request_success = Counter(
            name("request_success"), "Choices finished, by finish reason",
            ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram(
            name("time_to_first_token_seconds"), "From the request's streams opening at the "
            "gateway to the first data frame of a choice", model, registry=r,
            buckets=LATENCY_BUCKETS)
        self.itl = Histogram(
            name("inter_token_latency_seconds"), "Between successive data frames of a choice "
            "(one frame carries the tokens of one engine step)", model, registry=r,
            buckets=LATENCY_BUCKETS)
        self.e2e = Histogram(
            name("e2e_request_latency_seconds"), "From the request's streams opening at the "
            "gateway to a choice's final frame", model, registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Histogram(
            name("request_prompt_tokens"), "Prompt tokens of each finished choice", model,
            registry=r, buckets=TOKEN_BUCKETS)
        self.generation_tokens = Histogram(
            name("request_generation_tokens"), "Generated tokens of each finished choice",
            model, registry=r, buckets=TOKEN_BUCKETS)
        self.hop = Histogram(
            name("hop_latency_seconds"), "Round trip of one hop's admission request (gateway "
            "-> tokenizer includes tokenizing and the engine's admission)",
            ["hop", "model_name"], registry=r, buckets=LATENCY_BUCKETS)

        self._models: dict[str, ModelSeries] = {}

    def rate_limit_hit(self, key: str, limit: str) -> None:
        """A per-key limit (`requests` or `tokens`) refused a request of `key` (its id, never
        the secret)."""
        self.rate_limit_hits.labels(key, limit).inc()

    def timer(self, model: str) -> ChoiceTimer:
        series = self._models.get(model)
        if series is None:  # the model's labelled series, looked up once (models are served
            series = self._models[model] = ModelSeries(  # ones: the routes checked the name)
                self.ttft.labels(model), self.itl.labels(model), self.e2e.labels(model),
                self.prompt_tokens.labels(model), self.generation_tokens.labels(model),
                self.hop.labels("gateway_tokenizer", model))
        return ChoiceTimer(self, model, series)

    def render(self) -> bytes:
        if self.multiproc_dir is not None:
            return generate_latest(multiprocess_registry(self.multiproc_dir))
        assert self.registry is not None
        return generate_latest(self.registry)


class ModelSeries(NamedTuple):
    """One model's per-choice histograms."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    prompt_tokens: Histogram
    generation_tokens: Histogram
    admission: Histogram


class ChoiceTimer:
    """The timings of one request's choices, fed by its stream reader (see the module rules)."""

    def __init__(self, metrics: GatewayMetrics, model: str, series: ModelSeries):
        self.metrics, self.model, self.series = metrics, model, series
        self.start = time.monotonic()
        self._last: dict[int, float] = {}  # choice -> time of its latest data frame

    def admitted(self, since: float) -> None:
        self.series.admission.observe(time.monotonic() - since)

    def data(self, choice: int) -> None:
        now = time.monotonic()
        last = self._last.get(choice)
        if last is None:
            self.series.ttft.observe(now - self.start)
        else:
            self.series.itl.observe(now - last)
        self._last[choice] = now

    def final(self, final: TextFinal) -> None:
        series = self.series
        series.e2e.observe(time.monotonic() - self.start)
        self.metrics.request_success.labels(self.model, final.finish_reason).inc()
        series.prompt_tokens.observe(final.usage.prompt_tokens)
        series.generation_tokens.observe(final.usage.completion_tokens)


class MetricsMiddleware:
    """ASGI middleware: see the module rules."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        m = self.metrics
        status = 0

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        m.in_flight.inc()
        try:
            await self.app(scope, receive, counted_send)
        finally:
            m.in_flight.dec()
            if status:
                route = scope.get("route")
                endpoint = getattr(route, "path", None) or "other"
                m.http_requests.labels(endpoint, scope["method"], str(status)).inc()
                cause = scope.get(CAUSE_KEY) or CAUSES.get(status)
                if cause is not None:
                    m.rejections.labels("gateway", cause).inc()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw = request.app.state.gateway
    # off the event loop: with several workers, reading their files takes ~13 ms
    body = await asyncio.to_thread(gw.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
