"""Split-K for the decode GEMVs, finished inside the same launch.

Programs that share an output tile each sum a slice of K; each writes its fp32 partial to a
workspace [SPLIT_K, ...] and bumps the tile's counter; the last to arrive adds the partials,
writes the result and resets the counter to 0 (one launch, no zeroing pass, no reduction
kernel). The counters belong to one stream at a time per device (the engine runs one stream a
device) and must exist before any CUDA-graph capture (a zero-fill recorded in a capture would
not run before eager launches): the engine warms every shape up eagerly first.
"""

from __future__ import annotations

import torch

from flotilla.kernels.triton_compat import tl, triton

LOCKS = 4096  # split-K counters per device: output tiles of one launch
_locks: dict[torch.device, torch.Tensor] = {}


def lock_buffer(device: torch.device) -> torch.Tensor:
    """The device's zeroed split-K counters (every launch leaves them at 0)."""
    if device not in _locks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K counters first used inside a CUDA-graph capture: run "
                               "the shape eagerly first")
        _locks[device] = torch.zeros(LOCKS, dtype=torch.int32, device=device)
    return _locks[device]


@triton.jit
def split_k_store(acc, ws_ptrs, out_ptrs, mask, lock_ptr, pid_k, split_stride,
                  SPLIT_K: tl.constexpr):
    """Stores a program's fp32 tile `acc`: straight into out (SPLIT_K == 1), else as partial
    pid_k at ws_ptrs + pid_k * split_stride; the last slice of the tile to arrive (counter at
    lock_ptr) writes the sum of all partials to out."""
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptrs + pid_k * split_stride, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(lock_ptr, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for i in tl.static_range(SPLIT_K):  # .cg: not the L1's copy from an older launch
                total += tl.load(ws_ptrs + i * split_stride, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr, 0)
