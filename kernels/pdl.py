"""Programmatic dependent launch (PDL, Hopper and later) for the decode kernels.

A decode step is a chain of short kernels (per layer: norm, q/k/v GEMV, rotary + KV write,
attention split and merge, o GEMV, norm, gate/up GEMV, down GEMV); at batch 1 each boundary
costs the next kernel's launch and ramp-up, and the GEMVs on the small matrices spend about as
long starting as streaming their weights. Launched with PDL, a kernel's programs may start while
the previous kernel still runs: each first does what does not depend on it (address arithmetic;
the GEMVs also issue their first weight loads, since weights are never written), then waits
(`griddepcontrol.wait`: the previous grid has finished and its writes are visible) and at once
lets the next kernel launch. CUDA graphs keep these edges when the launches are captured.

Rule: every kernel launched with `pdl_args` calls `pdl_wait(USE_PDL)` (or `pdl_wait_after`) in
every program, before it reads anything a kernel may have written (activations, the KV cache;
weights and the step's metadata, copied from the host before the graph runs, may be read
earlier) and before it writes anything. Then a kernel's completion implies its predecessors',
so a dependence two kernels back is safe too.

The selection's `pdl` (FLOTILLA_PDL, kernels/selection.py) = auto (default: CUDA devices of
compute capability 9.0+), 1 (same), 0 (off); each launching function takes it as its `pdl`
argument.
Measured on an H100 (bench/quant_bench.py, B1 decode tok/s, same run): GPTQ 354 -> 377 with
the wait first in every kernel -> 381 with the GEMVs' first weight loads ahead of their wait
(`pdl_wait_after`); bf16 176 -> 184.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from flotilla.kernels.code_floats import INTERPRET
from flotilla.kernels.triton_compat import tl, triton

PDL_MODES = ("auto", "0", "1")


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Waits for the previous kernel (launched with PDL), then lets the next one launch.
    Returns an int32 0 that the compiler cannot see through: kernels whose activation loads are
    pure inline asm (kernels/vector_loads.py, free to move across other asm) add it to their
    activation pointers, so those loads cannot be scheduled before the wait."""
    token = 0
    if USE_PDL:
        token = tl.inline_asm_elementwise(
            "griddepcontrol.wait; griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [],
            dtype=tl.int32, is_pure=False, pack=1)
    return token


@triton.jit
def pdl_wait_after(words, USE_PDL: tl.constexpr):
    """pdl_wait, issued only once the loaded int32 tensor `words` (a GEMV's first weight
    words) has arrived. ptxas hoists a plain wait above every load of the kernel; a wait
    predicated on loaded data (both ways round: it always runs) keeps those loads in flight
    while the previous kernel finishes. Costs one block-wide reduction of the zero tokens."""
    token = 0
    if USE_PDL:
        tokens = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.eq.u32 p, $1, 0; @p griddepcontrol.wait; "
            "@!p griddepcontrol.wait; griddepcontrol.launch_dependents; mov.u32 $0, 0; }",
            "=r,r", [words], dtype=tl.int32, is_pure=False, pack=1)
        token = tl.max(tokens)
    return token


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(t: torch.Tensor, mode: str = "auto") -> bool:
    """`mode`: the selection's pdl (auto, 1 or 0)."""
    if not t.is_cuda or INTERPRET or mode == "0":
        return False
    return _device_ok(t.device.index if t.device.index is not None else
                      torch.cuda.current_device())


def pdl_args(t: torch.Tensor, mode: str = "auto") -> dict[str, Any]:
    """Launch keywords for a kernel with a USE_PDL constexpr whose data lives with `t`, under
    the selection's pdl `mode`."""
    if pdl_enabled(t, mode):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
