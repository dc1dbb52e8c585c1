"""The CPU decode step as one C++ call (cpu_native/decode_step.cpp), built on first use.

A batch-1 decode step of a small model on a small CPU is bound by dispatches: the torch path
(cpu_decode.py) runs ~35 ops a layer, each a Python call, an ATen dispatch and, for the
parallel ones, an OpenMP wake-up; and ATen's CPU attention for one query row (SDPA's flash
kernel) takes ~100-200 us a layer where the arithmetic needs a few. The extension runs the whole
step in one call: the int4 / int8 matmuls are ATen's (the same kernels as the torch path), the
norms, rotary, KV writes, attention over the paged cache in place, SiLU-and-mul and residual adds
are loops on the calling thread.

Built with torch.utils.cpp_extension (gcc, -O3 -march=native) into torch's extension cache
under a name that hashes the source, the torch version and the CPU, so a cached build is reused
only where it was compiled for. Where it cannot be built (no compiler, no ninja, a failed
build) `decode_step()` returns None once, with a warning, and cpu_decode.py keeps its torch
path. Numerics: tests/engine/test_cpu_native.py (logits against the torch path within a stated
tolerance, greedy tokens equal).
"""

from __future__ import annotations

import hashlib
import logging
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native") / "decode_step.cpp"
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17"]
_state: dict[str, Any] = {}


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(keep[:2])


def build_name() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_id().encode(),
                 " ".join(CFLAGS).encode()):
        digest.update(part)
    return f"flotilla_cpu_decode_{digest.hexdigest()[:12]}"


def decode_step() -> Callable[..., torch.Tensor] | None:
    """torch.ops.flotilla_cpu_decode.decode_step, built (or loaded from the cache) on the first
    call; None where it cannot be built."""
    if "op" not in _state:
        _state["op"] = _load()
    op: Callable[..., torch.Tensor] | None = _state["op"]
    return op


def _load() -> Callable[..., torch.Tensor] | None:
    if platform.system() != "Linux":
        return None
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name=build_name(), sources=[str(SOURCE)], extra_cflags=CFLAGS,
                           is_python_module=False, verbose=False)
        op: Callable[..., torch.Tensor] = torch.ops.flotilla_cpu_decode.decode_step
    except Exception as exc:  # any build or load failure: the torch path serves
        log.warning("CPU decode extension unavailable (%s: %s); using the torch decode path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    return op
