"""The tokenizer's Prometheus metrics (docs/metrics.md), served on `settings.metrics_port`.

`flotilla:hop_latency_seconds` with hop `tokenizer_prepare` (chat template and tokenizing,
including the wait for a worker thread) and `tokenizer_engine` (the engine's admission round
trip); `flotilla:request_rejections_total` (service `tokenizer`) for its overload and deadline
refusals and those of the engine it passes on, by error code; the streams it relays.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from flotilla.libs.common.messages import ErrorInfo
from flotilla.libs.common.metrics import LATENCY_BUCKETS, name, service_registry


class TokenizerMetrics:
    def __init__(self, model: str, streams: Callable[[], int]):
        self.registry = r = service_registry()
        hop = Histogram(name("hop_latency_seconds"), "Round trip of one hop's admission request, "
                        "or the tokenizer's preparation of a prompt", ["hop", "model_name"],
                        registry=r, buckets=LATENCY_BUCKETS)
        self.prepare = hop.labels("tokenizer_prepare", model)
        self.engine = hop.labels("tokenizer_engine", model)
        self.rejections = Counter(name("request_rejections"), "Requests refused, by the service "
                                  "that refused and why", ["service", "cause"], registry=r)
        running = Gauge(name("tokenizer_streams_running"), "Streams the tokenizer relays from "
                        "an engine", ["model_name"], registry=r)
        running.labels(model).set_function(lambda: float(streams()))

    def refused(self, error: ErrorInfo) -> None:
        """An admission refused with `error`: counted when it is an overload or deadline."""
        if error.status >= 500 or error.status == 429:
            self.rejections.labels("tokenizer", error.code or error.type).inc()
