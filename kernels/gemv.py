"""Small-batch GEMV in 16-bit floats: y [M, N] = x [M, K] @ W [N, K].T for decode (M <= 16).

Why our own (docs/benchmarks.md, B1): for the narrow decode matrices (q/k/v 6144x4096, o
4096x4096) cuBLAS picks split-K GEMVs that reach ~3.1 TB/s and launch a second, reduction kernel.
Here each program owns BLOCK_N output columns for every x row over the whole of K, so W is read
once, by one kernel, with no atomics and no reduction pass. Two inner products, chosen per config
(`USE_DOT`):
- FMA: [BLOCK_N, BLOCK_K] weight tiles (16-byte loads along K, rows clamped instead of masked so
  the loads stay vectorised). M == 1 accumulates element-wise and reduces once at the end; M > 1
  reduces each step per x row (a static loop keeps every tensor 2D, in the weight's layout).
- Tensor cores: x padded to 16 rows, `tl.dot(x, W_tile.T)`; the loads feed a dot, so Triton
  pipelines them through shared memory over `num_stages`.
`SILU_MUL`: x holds [gate | up] (width 2K) and the kernel reads silu(gate) * up, rounded like
kernels/activation.py, instead of x: the MLP's activation fused into the down projection's read.

Autotuning (`gemv_triton` on CUDA) is keyed on N, K and the M bucket (BLOCK_M, the next power of
two): the first call of each key benchmarks the configs, so it must happen in a warm-up before a
CUDA graph is captured (services/engine/cuda_graphs.py runs every bucket eagerly first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flotilla.kernels.activation import silu_mul
from flotilla.kernels.gemv_rows import check_gated, gemv_grid, gemv_rows
from flotilla.kernels.pdl import pdl_args, pdl_wait
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.tuning import warmup_autotune

GEMV_MAX_M = 16
_DTYPES = (torch.float16, torch.bfloat16)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    if silu_mul:
        half = x.shape[-1] // 2
        x = F.silu(x[..., :half]) * x[..., half:]
    return F.linear(x, weight)


@triton.jit
def _load_x(x_ptr, rm, m_ok, k, k_ok, stride_xm, K, SILU_MUL: tl.constexpr):
    """x [len(rm), len(k)] in x's dtype; with SILU_MUL, silu(gate) * up of the row."""
    ptrs = x_ptr + rm[:, None] * stride_xm + k[None, :]
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        x = silu_mul(x, tl.load(ptrs + K, mask=mask, other=0.0), x.dtype)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] (SILU_MUL: [M, 2K]) activations, unit stride along K
    w_ptr,  # [N, K] weights, unit stride along K
    out_ptr,  # [M, N] in x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,  # M bucket: next power of two of M (the autotune key)
    SILU_MUL: tl.constexpr,
    GATED: tl.constexpr,  # W = [gate; up]: out = silu(x gate^T) * (x up^T) (kernels/gemv_rows.py)
    BLOCK_N: tl.constexpr,  # output columns (weight rows) per program
    BLOCK_K: tl.constexpr,  # K per loop step
    USE_DOT: tl.constexpr,  # tensor-core inner product (x padded to 16 rows)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py)
):
    pid = tl.program_id(0)
    # clamped rows re-read row N - 1 instead of masking, so weight loads stay unmasked
    w_rows = w_ptr + gemv_rows(pid, N, BLOCK_N, GATED)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    pdl_wait(USE_PDL)
    if USE_DOT:
        rm = tl.arange(0, 16)
        m_ok = rm < M
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + k[None, :])
            else:
                w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
            x = _load_x(x_ptr, rm, m_ok, k, k < K, stride_xm, K, SILU_MUL)
            acc = tl.dot(x, tl.trans(w), acc)
    elif BLOCK_M == 1:
        m_ok = tl.arange(0, 1) < M
        rm = tl.arange(0, 1)
        acc_nk = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + k[None, :])
            else:
                w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
            x = _load_x(x_ptr, rm, m_ok, k, k < K, stride_xm, K, SILU_MUL)
            acc_nk += w.to(tl.float32) * x.to(tl.float32)
        acc = tl.sum(acc_nk, axis=1)[None, :]
    else:
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + k[None, :]).to(tl.float32)
            else:
                w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
            for i in tl.static_range(BLOCK_M):
                row = tl.arange(0, 1) + i
                x = _load_x(x_ptr, row, row < M, k, k < K, stride_xm, K, SILU_MUL)
                part = tl.sum(w * x.to(tl.float32), axis=1)
                acc += tl.where((rm == i)[:, None], part[None, :], 0.0)
    dtype = out_ptr.dtype.element_ty
    if GATED:  # columns pair up as (gate, up): kernels/gemv_rows.py
        gate, up = tl.split(tl.reshape(acc, [acc.shape[0], BLOCK_N // 2, 2]))
        rn = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        val = silu_mul(gate, up, dtype)
        n_ok = rn < N // 2
    else:
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        val = acc.to(dtype)
        n_ok = rn < N
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, val, mask=m_ok[:, None] & n_ok[None, :])


def _config(bn: int, bk: int, dot: bool, warps: int, stages: int = 1) -> triton.Config:
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "USE_DOT": dot}, num_warps=warps,
                         num_stages=stages)


# FMA tiles move 16 (4 warps) to 64 (8 warps) bytes of weights per thread and step; dot tiles are
# 16-32 rows deep with 3-4 pipelined stages.
CONFIGS = [
    _config(4, 1024, False, 4),
    _config(8, 512, False, 4),
    _config(8, 1024, False, 8),
    _config(16, 512, False, 8),
    _config(2, 2048, False, 4),
    _config(4, 512, False, 2),
    _config(1, 4096, False, 4),
    _config(2, 4096, False, 8),
    _config(2, 1024, False, 2),
    _config(16, 256, True, 4, 4),
    _config(32, 128, True, 4, 4),
    _config(16, 512, True, 4, 3),
    _config(32, 256, True, 8, 3),
]


def _prune(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
           ) -> list[triton.Config]:
    """M bucket 1: FMA tiles; 16: dot tiles; between: both, FMA ones only where the per-row
    reduction leaves registers for M rows."""
    bm = kwargs["BLOCK_M"]
    out = []
    for c in configs:
        if kwargs.get("GATED") and c.kwargs["BLOCK_N"] < 2:  # a (gate, up) pair per column
            continue
        dot = c.kwargs["USE_DOT"]
        per_thread = c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] // (32 * c.num_warps)
        if (bm == 1 and not dot) or (bm >= 16 and dot) or (1 < bm < 16 and (dot or per_thread
                                                                             <= 32)):
            out.append(c)
    return out or configs[:1]


def _even_k(args: dict[str, Any]) -> bool:
    return bool(args["K"] % args["BLOCK_K"] == 0)


_gemv_fixed = triton.heuristics({"EVEN_K": _even_k})(_gemv_kernel)
_gemv_tuned = warmup_autotune(CONFIGS, ["N", "K", "BLOCK_M", "GATED"],
                              prune_configs_by={"early_config_prune": _prune})(_gemv_fixed)


def interpreter_config(m: int, n: int, k: int) -> triton.Config:
    """Off CUDA (the interpreter, whose cost is per operation) one program takes nearly all."""
    return _config(min(triton.next_power_of_2(n), 64), min(triton.next_power_of_2(k), 256),
                   False, 4)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False,
                config: triton.Config | None = None, gated: bool = False,
                pdl: str = "auto") -> torch.Tensor:
    """x [..., K] (silu_mul: [..., 2K] = [gate | up]) @ weight [N, K].T -> [..., N] in x's
    dtype, for at most GEMV_MAX_M rows; gated (weight = [gate; up], N = 2I): silu(x gate^T) *
    (x up^T) [..., I]. `config` pins one tile config (tests); otherwise CUDA autotunes and the
    interpreter uses `interpreter_config`. `pdl`: the selection's pdl mode (kernels/pdl.py)."""
    n, k = weight.shape
    check_gated(n, gated)
    width = 2 * k if silu_mul else k
    if x.shape[-1] != width:
        raise ValueError(f"x has {x.shape[-1]} features, expected {width}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a 16-bit float dtype, got {x.dtype} and "
                         f"{weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight must have unit stride along K")
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > GEMV_MAX_M:
        raise ValueError(f"gemv_triton takes at most {GEMV_MAX_M} rows, got {m}")
    n_out = n // 2 if gated else n
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n_out)
    args = (x2, weight, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0))
    meta = dict(BLOCK_M=triton.next_power_of_2(m), SILU_MUL=silu_mul, GATED=gated,
                **pdl_args(x2, pdl))
    if config is None and x.is_cuda:
        _gemv_tuned[lambda a: (gemv_grid(n, a["BLOCK_N"], gated),)](*args, **meta)
    else:
        c = config or interpreter_config(m, n, k)
        if gated and c.kwargs["BLOCK_N"] < 2:
            raise ValueError("a gated GEMV needs BLOCK_N >= 2")
        _gemv_fixed[(gemv_grid(n, c.kwargs["BLOCK_N"], gated),)](
            *args, **meta, **c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    return out.reshape(*x.shape[:-1], n_out)


__all__ = ["CONFIGS", "GEMV_MAX_M", "gemv_ref", "gemv_triton", "interpreter_config"]
