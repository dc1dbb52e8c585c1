"""Kernel tests run the Triton launchers directly; without CUDA they run under the interpreter.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, i.e. when a kernel module is
imported, so it must be set before the first `import kernels...`. This conftest sets it (only
when CUDA is unavailable) and, if some earlier test module already imported the kernels compiled
mode, reloads them so the launchers see interpreted kernels.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _loaded = sorted(m for m in sys.modules if m == "kernels" or m.startswith("kernels."))
    for _name in [m for m in _loaded if m != "kernels"] + (["kernels"] if _loaded else []):
        importlib.reload(sys.modules[_name])

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> dict[str, float]:
    """assert_close tolerances for kernel-vs-reference comparisons in `dtype`."""
    return {k: v * scale for k, v in _TOLERANCES[dtype].items()}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A NaN-filled tensor: any element a kernel forgets to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
