"""A short run of bench/load_test.py against the package's suite: at 2x and 4x the concurrency
that saturates the engine (measured first, in the same run), every request finishes with a
finish_reason or is refused (429/503) with Retry-After within a second; none hangs, none is lost.
"""

from __future__ import annotations

import httpx
import pytest

from bench.load_test import run_phase, saturation, violations
from tests.e2e.conftest import MODEL, SuiteHandle

LEVELS = [1, 2, 4, 8]
LEVEL_S = 4.0
MULTIPLES = [2, 4]
OVERLOAD_S = 8.0
MAX_TOKENS = 16
STALL_S = 20.0  # no byte for this long is a hang
REFUSAL_BOUND_S = 1.0


@pytest.mark.slow
async def test_overload_ends_every_request_well(suite: SuiteHandle) -> None:
    suite.wait_ready(300)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=suite.root_url, limits=limits) as http:
        levels = [await run_phase(http, MODEL, f"level {c}", c, LEVEL_S, MAX_TOKENS, STALL_S)
                  for c in LEVELS]
        sat = saturation(levels)
        phases = [await run_phase(http, MODEL, f"{m}x", m * sat, OVERLOAD_S, MAX_TOKENS,
                                  STALL_S) for m in MULTIPLES]
    for phase in phases:
        assert len(phase.outcomes) >= phase.concurrency  # every worker's request ended
        bad = violations(phase, REFUSAL_BOUND_S)
        assert not bad, bad[:10]
    refused = [o for p in phases for o in p.outcomes if o.refused]
    assert all(o.retry_after for o in refused)
    print(f"\nsaturation {sat}; " + "; ".join(
        f"{p.name} ({p.concurrency}): {len(p.outcomes)} requests, "
        f"{sum(o.refused for o in p.outcomes)} refused" for p in phases))
