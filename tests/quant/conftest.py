"""Quantization tests: kernels run under the Triton interpreter without CUDA (as tests/kernels).

Set-up as tests/kernels/conftest.py (TRITON_INTERPRET before triton's first import, the
interpreter fixes, GPU-marked tests skipped without CUDA), plus one BLAS thread: the interpreter
runs each tl.dot as a small numpy matmul, and OpenBLAS spinning its thread pool on a busy 2-core
machine turns a 20 us product into 30 ms.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from flotilla.kernels.selection import KernelSelection
from tests.triton_setup import DEVICE, INTERPRETER_TOO_LATE, mark_items  # noqa: F401


def _single_thread_openblas() -> None:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # if numpy is not loaded yet
    for line in Path("/proc/self/maps").read_text().splitlines():
        lib = line.split()[-1]
        if "openblas" not in lib or ".so" not in lib:
            continue
        handle = ctypes.CDLL(lib)
        for fn in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                   "openblas_set_num_threads"):
            if hasattr(handle, fn):
                getattr(handle, fn)(1)
                return


try:
    import numpy  # noqa: F401  (load it, then pin its BLAS)

    _single_thread_openblas()
except OSError:
    pass


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in float64 (NaN fails every bound)."""
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm())


@pytest.fixture
def kernels_mode() -> KernelSelection:
    """The selection under which quantized layers run their Triton kernels even on CPU (the
    interpreter): pass it to load_model."""
    return KernelSelection(quant_kernels="triton")


@pytest.fixture
def dequant_mode() -> KernelSelection:
    """The selection under which quantized layers dequantize once after loading and serve float
    weights."""
    return KernelSelection(quant_kernels="torch")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_items(items, os.path.dirname(__file__), lambda item: "gpu" not in item.keywords)
