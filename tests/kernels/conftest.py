"""Kernel tests run the Triton launchers directly; without CUDA they run under the interpreter.

TRITON_INTERPRET is read when `@triton.jit` decorates a function: when triton itself is imported
(its standard library, e.g. tl.sigmoid, is jit code) and when each kernel module is. So it must be
set before the first `import triton` of the process. This conftest sets it when CUDA is missing;
if triton was already imported without it (a whole-suite run where an earlier test imported the
kernels), the interpreter tests are skipped with that reason: set TRITON_INTERPRET=1 in the
environment, or in the root conftest, to run them in such a session.

The interpreter itself needs a few fixes to match the GPU: see interpreter_fixes.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

INTERPRETER_TOO_LATE = False
if not torch.cuda.is_available():
    INTERPRETER_TOO_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.kernels import interpreter_fixes

    interpreter_fixes.apply()

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


_NO_INTERPRETER_NEEDED = {"test_dispatch.py", "test_compile_sm90.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    too_late = pytest.mark.skip(
        reason="triton was imported before TRITON_INTERPRET=1 was set (see conftest.py)"
    )
    here = os.path.dirname(__file__)
    for item in items:
        if not str(item.path).startswith(here):
            continue
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        elif INTERPRETER_TOO_LATE and item.path.name not in _NO_INTERPRETER_NEEDED:
            item.add_marker(too_late)
