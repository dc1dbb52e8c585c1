"""Which weight rows a decode-GEMV program dots, how it stores them (plainly, or gated), and the
launch the lanes-along-K GEMVs share (`lane_gemv`).

The lanes-along-K GEMVs (kernels/w4a16_gemv.py, gguf_kquant_gemv.py, fp8_gemv_fma.py) give each
program BLOCK_N weight rows and sum them over all of K, so a program holds whole dot products at
the end. Gated (`GATED`), the weight is a gated MLP's fused [gate; up] projection (N = 2I rows)
and the program takes BLOCK_N / 2 output columns c, dotting gate row c and up row I + c side by
side (interleaved: row pair i = (c, I + c)); its epilogue stores silu(gate) * up, I columns in
all. That is the MLP's SiLU·mul done in the gate/up GEMV's registers: one kernel launch and one
round trip of the [2I] activations less per layer and decode step. The rounding is the
unfused path's (kernels/activation.py `silu_mul`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flotilla.kernels.activation import silu_mul
from flotilla.kernels.code_floats import INTERPRET
from flotilla.kernels.pdl import pdl_args
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.vector_loads import x_words_ok


@triton.jit
def gemv_rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """int64 [BLOCK_N] weight rows of program pid_n, clamped into the weight (rows past its end
    re-read the last row: the vector loads take no mask; `gemv_store` drops them)."""
    i = tl.arange(0, BLOCK_N)
    if GATED:
        half = N // 2
        cols = pid_n * (BLOCK_N // 2) + i // 2
        rows = tl.minimum(cols, half - 1) + (i % 2) * half
    else:
        rows = tl.minimum(pid_n * BLOCK_N + i, N - 1)
    return rows.to(tl.int64)


@triton.jit
def gemv_store(out, out_row, pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """Stores a program's fp32 dot products `out` [BLOCK_N] (in `gemv_rows` order) into the
    output row at out_row: as they are, or gated (silu(gate) * up, BLOCK_N / 2 columns)."""
    dtype = out_row.dtype.element_ty
    if GATED:
        gate, up = tl.split(tl.reshape(out, [BLOCK_N // 2, 2]))
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_row + cols, silu_mul(gate, up, dtype), mask=cols < N // 2)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_row + cols, out.to(dtype), mask=cols < N)


def lane_gemv(tuned: Any, fixed: Any, x2: torch.Tensor, n: int, gated: bool,
              args: Callable[[torch.Tensor], tuple[Any, ...]], meta: dict[str, Any],
              run: int, block_n: int | None, nsb: int, prefetch: bool,
              num_warps: int, pdl: str = "auto") -> torch.Tensor:
    """Launches one of the lanes-along-K GEMVs on x2 [M, K] with `n` weight rows; returns its
    output [M, N] (gated: [M, N / 2]). `args(out)` gives the kernel's positional arguments,
    `meta` its format's constexprs; K is walked in steps of `run` * NSB weights. On CUDA without
    a pinned block_n the tile comes from `tuned` (autotuned before any CUDA-graph capture), else
    `fixed` runs the pinned tile. `pdl`: the selection's pdl mode (kernels/pdl.py)."""
    check_gated(n, gated)
    m, k = x2.shape
    out = torch.empty(m, n // 2 if gated else n, dtype=x2.dtype, device=x2.device)
    meta = dict(meta, GATED=gated, USE_ASM=x2.is_cuda and not INTERPRET,
                X_WORDS=x_words_ok(x2), **pdl_args(x2, pdl))
    if x2.is_cuda and block_n is None:
        tuned[lambda a: (gemv_grid(n, a["BLOCK_N"], gated), m)](*args(out), **meta)
    else:
        bn = block_n or 8
        fixed[(gemv_grid(n, bn, gated), m)](
            *args(out), **meta, EVEN=k % (run * nsb) == 0, BLOCK_N=bn, NSB=nsb,
            PREFETCH=prefetch, num_warps=num_warps)
    return out


def gemv_grid(n: int, block_n: int, gated: bool) -> int:
    """Programs along N for `n` weight rows."""
    return triton.cdiv(n // 2, block_n // 2) if gated else triton.cdiv(n, block_n)


def check_gated(n: int, gated: bool) -> None:
    if gated and n % 2:
        raise ValueError(f"a gated GEMV needs an even number of weight rows ([gate; up]), got {n}")
