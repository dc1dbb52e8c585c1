"""Autotuning for the decode GEMVs: `warmup_autotune` is `triton.autotune` with short benchmarks.

The engine tunes every (shape, M bucket) of its GEMVs in the warm-up before CUDA-graph capture
(cuda_graphs.py runs each bucket eagerly first), so tens of configs x shapes must tune in seconds:
5 warm-up and 20 timed runs a config instead of Triton's default 25 ms / 100 ms budgets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flotilla.kernels.triton_compat import triton


def _short_bench(fn: Callable[[], Any], quantiles: Sequence[float] | None = None) -> Any:
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def warmup_autotune(configs: list[triton.Config], key: list[str], **kwargs: Any) -> Any:
    """Decorator: triton.autotune over `configs` keyed on `key`, timed with short benchmarks."""
    return triton.autotune(configs, key=key, do_bench=_short_bench, **kwargs)
