"""Kernel tests run the Triton launchers directly; without CUDA they run under the interpreter.

TRITON_INTERPRET is read when `@triton.jit` decorates a function: when triton itself is imported
(its standard library, e.g. tl.sigmoid, is jit code) and when each kernel module is. So it must be
set before the first `import triton` of the process. tests/triton_setup.py (imported here) sets
it when CUDA is missing; if triton was already imported without it (a whole-suite run where an
earlier test imported the kernels), the interpreter tests are skipped with that reason (the root
tests/conftest.py sets TRITON_INTERPRET first to prevent that).

The interpreter itself needs a few fixes to match the GPU: see interpreter_fixes.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.triton_setup import DEVICE, INTERPRETER_TOO_LATE, mark_items  # noqa: F401

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
    mark_items(items, os.path.dirname(__file__),
               lambda item: item.path.name not in _NO_INTERPRETER_NEEDED)
