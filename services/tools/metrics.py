"""The tools service's Prometheus metrics (docs/metrics.md), served on `settings.metrics_port`:
MCP tool calls by server and outcome, and their duration."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from flotilla.libs.common.metrics import LATENCY_BUCKETS, name, service_registry


class ToolsMetrics:
    def __init__(self) -> None:
        self.registry = r = service_registry()
        self.calls = Counter(name("tool_calls"), "MCP tool calls, by server and outcome (ok, "
                             "error, crashed)", ["server", "outcome"], registry=r)
        self.seconds = Histogram(name("tool_call_seconds"), "Duration of MCP tool calls",
                                 ["server"], registry=r, buckets=LATENCY_BUCKETS)
