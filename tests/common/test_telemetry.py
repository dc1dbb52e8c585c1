"""Tracing set-up: no exporter means no recording provider, and a caller's trace still flows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from flotilla.libs.common import telemetry
from flotilla.libs.common.settings import CommonSettings

telemetry.setup_tracing("probe", CommonSettings(otel_exporter=EXPORTER))
caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ctx = telemetry.extract_context({"traceparent": caller})
token = telemetry.attach(ctx)
with telemetry.tracer("probe").start_as_current_span("hop"):
    passed = telemetry.inject_headers()
telemetry.detach(token)
with telemetry.tracer("probe").start_as_current_span("fresh"):
    fresh = telemetry.inject_headers()
print(json.dumps({"sdk": isinstance(trace.get_tracer_provider(), TracerProvider),
                  "passed": passed.get("traceparent", ""), "fresh": fresh}))
"""


def _probe(exporter: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.replace("EXPORTER", repr(exporter))],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_an_exporter_spans_are_not_recorded_but_a_callers_trace_passes_on() -> None:
    none = _probe("none")
    assert none["sdk"] is False
    assert none["passed"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    assert none["fresh"] == {}  # nothing to pass on: no headers at all


def test_console_exporter_records_spans_with_fresh_trace_ids() -> None:
    console = _probe("console")
    assert console["sdk"] is True
    assert console["passed"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    assert len(console["fresh"]["traceparent"].split("-")[1]) == 32
