"""The engine's Prometheus metrics (docs/metrics.md), served on `settings.metrics_port`.

Rules:
- What the engine already counts (its `stats()`: running and waiting requests, KV blocks,
  prompt / generated / prefix-cache tokens, preemptions, finished requests) is read when
  Prometheus scrapes (`_StatsCollector`), never pushed from the step loop: the loop pays nothing
  for those.
- Per-step distributions (step time, sequences and tokens per step, queue time of the requests
  first scheduled in the step) are observed by `observe_step`, which the step loop calls once
  per step from its own thread (a handful of histogram observations).
- Every series carries `model_name` and `engine` (the instance id), so replicas stay apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from flotilla.libs.common.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, name, service_registry

# stats() key -> (metric, help); counters since the engine started
COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens admitted"),
    "tokens_generated": ("generation_tokens", "Tokens generated"),
    "prefix_cache_query_tokens": ("prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hit_tokens": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "preemptions": ("num_preemptions", "Requests preempted (their KV blocks freed, recomputed "
                    "later)"),
}
FINISHED = {"finished": "finished", "aborted": "aborted", "failed": "failed"}


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], labels: dict[str, str],
                 refused: Callable[[], dict[str, int]]):
        self.stats, self.labels, self.refused = stats, labels, refused

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        keys, values = list(self.labels), list(self.labels.values())
        for metric, key, doc in (("num_requests_running", "running", "Requests running"),
                                 ("num_requests_waiting", "waiting",
                                  "Requests waiting for their first step")):
            family = GaugeMetricFamily(name(metric), doc, labels=keys)
            family.add_metric(values, s.get(key, 0))
            yield family
        usage = GaugeMetricFamily(name("kv_cache_usage_perc"), "Share of KV-cache blocks in use "
                                  "(1 = full)", labels=keys)
        total = s.get("kv_blocks_total", 0)
        usage.add_metric(values, s.get("kv_blocks_used", 0) / total if total else 0.0)
        yield usage
        for key, (metric, doc) in COUNTERS.items():
            counter = CounterMetricFamily(name(metric), doc, labels=keys)
            counter.add_metric(values, s.get(key, 0))
            yield counter
        done = CounterMetricFamily(name("engine_requests_finished"), "Requests that left the "
                                   "engine, by how", labels=[*keys, "outcome"])
        for key, outcome in FINISHED.items():
            done.add_metric([*values, outcome], s.get(key, 0))
        yield done
        refusals = CounterMetricFamily(name("request_rejections"), "Requests refused, by the "
                                       "service that refused and why", labels=["service", "cause"])
        for cause, count in sorted(self.refused().items()):
            refusals.add_metric(["engine", cause], count)
        yield refusals


class EngineMetrics:
    """`EngineMetrics(model, engine_id, stats, refused)`: `stats` is the loop's `stats()`,
    `refused` the engine's refusal counts by cause (error code)."""

    def __init__(self, model: str, engine_id: str, stats: Callable[[], dict[str, Any]],
                 refused: Callable[[], dict[str, int]]):
        self.registry = service_registry()
        labels = {"model_name": model, "engine": engine_id}
        self.registry.register(_StatsCollector(stats, labels, refused))
        keys, r = list(labels), self.registry
        self.step_time = Histogram(name("engine_step_seconds"), "Duration of one engine step",
                                   keys, registry=r, buckets=LATENCY_BUCKETS).labels(**labels)
        self.batch_size = Histogram(name("engine_batch_size"), "Sequences in one engine step",
                                    keys, registry=r, buckets=BATCH_BUCKETS).labels(**labels)
        self.step_tokens = Histogram(name("iteration_tokens_total"), "Tokens in one engine step",
                                     keys, registry=r, buckets=BATCH_BUCKETS).labels(**labels)
        self.queue_time = Histogram(
            name("request_queue_time_seconds"), "From a request's arrival at the engine to its "
            "first step", keys, registry=r, buckets=LATENCY_BUCKETS).labels(**labels)

    def observe_step(self, step_s: float, sched: Any) -> None:
        """Called by the step loop's thread once per step; `sched` is its SchedulerOutput."""
        self.step_time.observe(step_s)
        if sched is None:
            return
        self.batch_size.observe(len(sched.requests))
        self.step_tokens.observe(sched.num_batched_tokens)
        for wait in sched.queue_waits:
            self.queue_time.observe(wait)
