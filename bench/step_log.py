"""Reading the engine's step log (FLOTILLA_STEP_LOG, services/engine/loop.py) around a burst:
how it was admitted and how its decode ran. Used by bench/suite_bench.py."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def burst_steps(step_log: Path, t0: float, t1: float) -> dict:
    """The engine's steps (FLOTILLA_STEP_LOG lines) between t0 and t1 (epoch s): how the burst
    was admitted. Times are ms after t0; only steps that admitted requests, ran prefill or
    delivered first tokens are listed."""
    rows = [json.loads(line) for line in step_log.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if t0 <= r["t"] <= t1]
    shown = [[round((r["t"] - t0) * 1e3, 1), r["step_ms"], r.get("phases_ms"), r.get("gc_ms"),
              r["added"], r["tokens"], r["prefills"], r["first_tokens"]] for r in rows
             if r["added"] or r["prefills"] or r["first_tokens"]]
    firsts = [r for r in rows if r["first_tokens"]]
    arrived = sorted((t - t0) * 1e3 for r in rows for t in r.get("arrivals", []))
    return {"steps": len(rows), "arrivals_ms": quantiles(arrived),
            "columns": ["t_ms", "step_ms", "phases_ms", "gc_ms", "added", "tokens", "prefills",
                        "first_tokens"],
            "admission": shown,
            "last_first_token_ms": round((firsts[-1]["t"] + firsts[-1]["step_ms"] / 1e3 - t0)
                                         * 1e3, 1) if firsts else None,
            "decode": decode_hiccups(rows, t0)}


def decode_hiccups(rows: list[dict], t0: float) -> dict:
    """Steps after the burst's last prefill whose start-to-start interval exceeds 1.5x the
    median (the first interval after the prefill is its GPU time, not counted): how many, the
    time they add over the median, and the slowest five with their step() phases (ms: up to
    the launch, the launch, collecting the previous step) and GC time."""
    last = max((i for i, r in enumerate(rows) if r["prefills"]), default=-1)
    after = rows[last + 1:]
    gaps = [(b["t"] - a["t"]) * 1e3 for a, b in zip(after, after[1:], strict=False)][1:]
    if len(gaps) < 3:
        return {}
    med = statistics.median(gaps)
    slow = [(g, after[i + 1]) for i, g in enumerate(gaps) if g > 1.5 * med]
    worst = sorted(slow, key=lambda x: -x[0])[:5]
    return {"median_ms": round(med, 3), "hiccups": len(slow),
            "excess_ms": round(sum(g - med for g, _ in slow), 1),
            "slowest": [{"t_ms": round((r["t"] - t0) * 1e3, 1), "interval_ms": round(g, 1),
                         "step_ms": r["step_ms"], "phases_ms": r.get("phases_ms"),
                         "gc_ms": r.get("gc_ms")} for g, r in worst]}


def quantiles(values: list[float]) -> dict[str, float]:
    """min / p10 / p50 / p90 / max of `values` (rounded to 0.1)."""
    v = sorted(values)
    if not v:
        return {}
    at = {"min": 0.0, "p10": 0.1, "p50": 0.5, "p90": 0.9, "max": 1.0}
    return {k: round(v[min(len(v) - 1, int(q * len(v)))], 1) for k, q in at.items()}
