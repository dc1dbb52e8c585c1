"""Prometheus metrics shared by every service: names, buckets, and the /metrics server.

Rules:
- Every metric is named `flotilla:<name>` after vLLM's `vllm:<name>` where vLLM has one
  (docs/metrics.md lists them all); models are labelled `model_name`, as vLLM does.
- Each service instance owns a `CollectorRegistry` of its own (never prometheus-client's global
  one), so several services in one process (the tests) keep separate counts.
- The tokenizer, engine and tools services serve their registry on `settings.metrics_port`
  (`MetricsServer`; 0 = off); the gateway serves it on its API port (services/gateway/metrics.py).
- Several gateway worker processes share one set of numbers through prometheus-client's
  multiprocess mode: the parent names a directory in `PROMETHEUS_MULTIPROC_DIR` for its workers
  (services/gateway/workers.py) and every worker's /metrics reads all of their files.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector

log = logging.getLogger(__name__)

PREFIX = "flotilla:"
# seconds: from a millisecond (a cached decode step) to ten minutes (the default deadline)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# tokens of one request (prompt or generated), as vLLM's 1-2-5 series
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)
# sequences or tokens of one engine step
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def name(metric: str) -> str:
    return PREFIX + metric


def service_registry() -> CollectorRegistry:
    """A registry of one service instance, with the process's CPU and memory
    (`process_cpu_seconds_total`, `process_resident_memory_bytes`)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


def multiprocess_registry(directory: Path) -> CollectorRegistry:
    """What /metrics shows when several processes write to `directory`: all of them summed."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return registry


class MetricsServer:
    """prometheus-client's HTTP server for `registry` on `port` (a thread of its own, so a
    busy event loop or step loop does not delay a scrape); `port` 0 = no server."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.registry, self.host, self.port = registry, host, port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.port:
            return
        self._server, self._thread = start_http_server(self.port, self.host,
                                                       registry=self.registry)
        self.port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
