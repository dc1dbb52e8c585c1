"""FP8 (e4m3) decode GEMV on the tensor cores: y [M, N] = x [M, K] @ (W8 * scale).T for M <= 2.

Why: the CUDA-core GEMV in kernels/fp8.py spends ~7 SASS instructions per weight in its loop
(convert, FMA, per-chunk reductions). Here each [BLOCK_N, BLOCK_K] weight tile is converted
e4m3 -> fp16 (one F2FP per two weights; exact: every e4m3 value is an fp16) and multiplied with
`tl.dot(W16, x16.T)` (wgmma on sm90; x padded to 16 rows, the padding zeros known at compile
time), summing in fp32: ~1.4-2 instructions per weight (tests/quant/sm90_compile.py `fp8loop`).
- K order inside a tile: the dot is a sum over K, so any permutation applied to both operands
  leaves it unchanged. `_logical_k` reorders each tile so that the 16 fp8 bytes a thread loads
  with one 16-byte access are the ones its wgmma fragment needs; without it Triton converts the
  fp8 tile through shared memory two bytes at a time (an LDS per two weights).
- x in fp16: bf16 activations may exceed fp16's range, so each program first takes max|x| of
  every row over its K slice and multiplies the row by 32768 / max (the result by max / 32768);
  x keeps ~11 bits. fp16 x is used as is; fp32 x keeps the exact CUDA-core kernel (kernels/fp8.py).
  x rows and group scales are too narrow for the cp.async pipeline that streams W (num_stages):
  they are loaded one step ahead in registers.
- Scales: per-channel ones multiply the result once; group scales (group a multiple of BLOCK_K)
  scale each tile's dot before it joins the accumulator.
- Split-K (SPLIT_K > 1): programs over (row block, K slice) so narrow matrices fill every SM.
  Each writes its fp32 partial to a workspace and bumps a per-row-block counter; the last one
  adds the partials, writes y and resets the counter to 0 (one launch, no zeroing pass; the
  counters belong to one stream at a time per device).
The tile, stages, warps and SPLIT_K are autotuned per (N, K, group) on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from flotilla.kernels.split_k import LOCKS, lock_buffer, split_k_store
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.tuning import warmup_autotune

MAX_M = 2  # rows of x (the dot pads them to 16 columns)
X_RANGE = tl.constexpr(32768.0)  # bf16 rows are scaled so that max|x| is this (fp16 max: 65504)


@triton.jit
def _logical_k(t, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS, BLOCK_K] in memory order -> the same columns in the order the dot sees them:
    dot column 16j + 8h + 2c + p is memory column c * BLOCK_K / 4 + 4j + 2h + p, so each of the
    4 threads sharing a row of a wgmma fragment (c) reads one contiguous quarter of the tile."""
    t = tl.reshape(t, [ROWS, 4, BLOCK_K // 16, 2, 2])
    t = tl.permute(t, [0, 2, 3, 1, 4])
    return tl.reshape(t, [ROWS, BLOCK_K])


@triton.jit
def _row_max(x_ptr, M, stride_xm, k_lo, k_hi, BLOCK_M: tl.constexpr):
    """max |x[m, k_lo:k_hi]| of rows m < BLOCK_M (0 for rows >= M), float32 [BLOCK_M]. Whole
    slices of up to 4096 in one step: the weight stream starts after this."""
    XB: tl.constexpr = 4096
    rm = tl.arange(0, BLOCK_M)
    offs = tl.arange(0, XB)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, XB):
        k = k0 + offs
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                    mask=(rm < M)[:, None] & (k < k_hi)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return amax


@triton.jit
def _x_rows(x_ptr, M, stride_xm, k, k_hi, BLOCK_M: tl.constexpr):
    """Rows 0 and 1 of x at columns k (zeros past k_hi or M; row 1 is row 0 if BLOCK_M == 1)."""
    x0 = tl.load(x_ptr + k, mask=k < k_hi, other=0.0)
    if BLOCK_M == 2:
        x1 = tl.load(x_ptr + stride_xm + k, mask=(k < k_hi) & (M > 1), other=0.0)
    else:
        x1 = x0
    return x0, x1


@triton.jit
def _x_tile(x0, x1, mul0, mul1, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
            SCALE_X: tl.constexpr):
    """The dot's fp16 x operand [16, BLOCK_K]: rows 0 and 1 (< BLOCK_M) converted, the padding
    rows zeros known at compile time."""
    rm16 = tl.arange(0, 16)[:, None]
    x16 = tl.where(rm16 == 0, _to_f16(x0, mul0, SCALE_X)[None, :], 0.0)
    if BLOCK_M == 2:
        x16 = tl.where(rm16 == 1, _to_f16(x1, mul1, SCALE_X)[None, :], x16)
    return x16.to(tl.float16)


@triton.jit
def _to_f16(x, mul, SCALE_X: tl.constexpr):
    if SCALE_X:
        return (x.to(tl.float32) * mul).to(tl.float16)
    return x.to(tl.float16)


@triton.jit
def _tile_dot(acc, w, x16, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PER_CHANNEL: tl.constexpr):
    """acc [BLOCK_N, 16] += W tile (e4m3) . x tile (fp16) [* group scales s], fp32 sums."""
    w16 = _logical_k(w.to(tl.float16), BLOCK_N, BLOCK_K)
    if PER_CHANNEL:
        acc = tl.dot(w16, tl.trans(x16), acc)
    else:
        acc += tl.dot(w16, tl.trans(x16)) * s[:, None]
    return acc


@triton.jit
def _gemv_mma_kernel(
    x_ptr,  # [M, K] bf16 or fp16 activations, unit stride along K
    w_ptr,  # e4m3 [N, K], unit stride along K
    s_ptr,  # float32 [N, K // group] scales
    out_ptr,  # [M, N] in x's dtype
    ws_ptr,  # float32 [SPLIT_K, M, N] partials (SPLIT_K > 1)
    lock_ptr,  # int32 [>= cdiv(N, BLOCK_N)] zeroed counters (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    group,
    BLOCK_M: tl.constexpr,  # 1 or 2: the next power of two of M
    SCALE_X: tl.constexpr,  # bf16 x: rows scaled into fp16 range (module docstring)
    PER_CHANNEL: tl.constexpr,  # group == K: one scale per row, applied to the result
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masked last tile
    BLOCK_N: tl.constexpr,  # weight rows per program: 64 per warpgroup of 4 warps
    BLOCK_K: tl.constexpr,  # K per step: a multiple of 64 dividing the group (group scales)
    SPLIT_K: tl.constexpr,  # K slices (programs along axis 1)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rn_c = tl.minimum(rn, N - 1)  # clamped: loads stay unmasked, stores are masked
    w_rows = w_ptr + rn_c.to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    rm16 = tl.arange(0, 16)
    mul0 = 1.0
    mul1 = 1.0
    y_mul = tl.full([16], 1.0, tl.float32)
    if SCALE_X:  # per-row x multipliers into fp16 range, and their inverses for the result
        amax = tl.maximum(_row_max(x_ptr, M, stride_xm, k_lo, k_hi, BLOCK_M), 1e-30)
        pick = rm16[:, None] == tl.arange(0, BLOCK_M)[None, :]
        y_mul = tl.sum(tl.where(pick, amax[None, :] / X_RANGE, 0.0), axis=1)  # 0: rows >= M
        mul0 = X_RANGE / tl.max(tl.where(tl.arange(0, BLOCK_M) == 0, amax, 0.0), axis=0)
        mul1 = X_RANGE / tl.max(tl.where(tl.arange(0, BLOCK_M) == 1, amax, 1e-30), axis=0)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    if EVEN_K:
        k_end = k_hi
    else:
        k_end = k_lo + tl.maximum(k_hi - k_lo, 0) // BLOCK_K * BLOCK_K
    # x rows (and group scales) are prefetched one step ahead: too narrow for the cp.async
    # pipeline of W; x is gathered in the dot's K order (_logical_k)
    j = tl.arange(0, BLOCK_K)
    offs_x = (j % 8 // 2) * (BLOCK_K // 4) + j // 16 * 4 + j % 16 // 8 * 2 + j % 2
    x0, x1 = _x_rows(x_ptr, M, stride_xm, k_lo + offs_x, k_hi, BLOCK_M)
    s_rows = s_ptr + rn_c * stride_sn
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    if not PER_CHANNEL:
        s = tl.load(s_rows + k_lo // group, mask=k_lo < k_hi, other=0.0)
    for k0 in range(k_lo, k_end, BLOCK_K):
        w = tl.load(w_rows + (k0 + offs_k)[None, :])
        x16 = _x_tile(x0, x1, mul0, mul1, BLOCK_M, BLOCK_K, SCALE_X)
        acc = _tile_dot(acc, w, x16, s, BLOCK_N, BLOCK_K, PER_CHANNEL)
        k_next = k0 + BLOCK_K
        x0, x1 = _x_rows(x_ptr, M, stride_xm, k_next + offs_x, k_hi, BLOCK_M)
        if not PER_CHANNEL:
            s = tl.load(s_rows + k_next // group, mask=k_next < k_hi, other=0.0)
    if not EVEN_K:
        if k_end < k_hi:  # the last, partial tile (per-channel scales only); x0, x1 hold it
            k = k_end + offs_k
            w = tl.load(w_rows + k[None, :], mask=(k < k_hi)[None, :], other=0.0)
            x16 = _x_tile(x0, x1, mul0, mul1, BLOCK_M, BLOCK_K, SCALE_X)
            acc = _tile_dot(acc, w, x16, s, BLOCK_N, BLOCK_K, PER_CHANNEL)
    acc = acc * y_mul[None, :]
    if PER_CHANNEL:
        acc = acc * tl.load(s_rows)[:, None]
    mask = n_ok[:, None] & (rm16 < M)[None, :]
    split_k_store(acc, ws_ptr + rm16[None, :] * N + rn[:, None],
                  out_ptr + rm16[None, :] * stride_om + rn[:, None], mask, lock_ptr + pid_n,
                  pid_k, M * N, SPLIT_K)


def _config(bn: int, bk: int, split: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=warps,
                         num_stages=stages)


# 64 rows per warpgroup (wgmma's M); 8-32 KiB of weights per stage; split-K 2-8 for the narrow
# matrices (Llama-3-8B o / down: 32 row blocks of 128 on 132 SMs)
CONFIGS = [
    _config(128, 128, 1, 4, 4),
    _config(128, 256, 1, 4, 3),
    _config(256, 128, 1, 8, 3),
    _config(64, 256, 1, 4, 3),
    _config(256, 128, 2, 8, 3),
    _config(128, 128, 2, 4, 4),
    _config(128, 256, 2, 4, 3),
    _config(64, 256, 2, 4, 3),
    _config(128, 128, 4, 4, 4),
    _config(128, 256, 4, 4, 3),
    _config(64, 128, 4, 4, 4),
    _config(128, 128, 8, 4, 4),
]
FALLBACK = _config(64, 64, 1, 4, 3)  # groups of 64; the interpreter
_SPLIT_MAX = max(c.kwargs["SPLIT_K"] for c in CONFIGS)


def _prune(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
           ) -> list[triton.Config]:
    """Group scales need BLOCK_K | group; a partial last tile BLOCK_K <= 128 (256 spills
    there); split-K needs >= 2 tiles per slice and few row blocks (not more than the
    counters)."""
    k, group = named_args["K"], named_args["group"]
    out = []
    for c in configs:
        bk, split = c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]
        if (group != k and group % bk) or (k % bk and bk > 128):
            continue
        if split > 1 and (triton.cdiv(k, bk) < 2 * split
                          or triton.cdiv(named_args["N"], c.kwargs["BLOCK_N"]) > LOCKS):
            continue
        out.append(c)
    return out or [FALLBACK]


def _even_k(args: dict[str, Any]) -> bool:
    return bool(args["K"] % args["BLOCK_K"] == 0)


_gemv_fixed = triton.heuristics({"EVEN_K": _even_k})(_gemv_mma_kernel)
_gemv_tuned = warmup_autotune(CONFIGS, ["N", "K", "group"],
                              prune_configs_by={"early_config_prune": _prune})(_gemv_fixed)
def mma_gemv_ok(x: torch.Tensor, k: int, group: int) -> bool:
    """The tensor-core GEMV takes 16-bit x and per-channel scales or groups that are multiples
    of 64 (fp32 x keeps the exact CUDA-core kernel)."""
    return x.dtype in (torch.float16, torch.bfloat16) and (group == k or group % 64 == 0)


def fp8_gemv_mma(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int,
                 config: triton.Config | None = None) -> torch.Tensor:
    """x2 [M, K] (16-bit, unit stride along K, M <= MAX_M) @ dequant(weight, scale).T -> [M, N]
    in x2's dtype. `config` pins one tile config (tests); otherwise CUDA autotunes and the
    interpreter runs FALLBACK."""
    m, k = x2.shape
    n = weight.shape[0]
    if m > MAX_M or not mma_gemv_ok(x2, k, group) or x2.stride(1) != 1:
        raise ValueError(f"fp8_gemv_mma takes <= {MAX_M} 16-bit rows with unit stride and "
                         f"group == K or a multiple of 64, got {tuple(x2.shape)} {x2.dtype} "
                         f"group {group}")
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    split = _SPLIT_MAX if config is None else config.kwargs["SPLIT_K"]
    ws = torch.empty(split if split > 1 else 0, m, n, dtype=torch.float32, device=x2.device)
    locks = lock_buffer(x2.device)
    args = (x2, weight, scale, out, ws, locks, m, n, k, x2.stride(0), weight.stride(0),
            scale.stride(0), out.stride(0), group)
    meta = dict(BLOCK_M=triton.next_power_of_2(m), SCALE_X=x2.dtype == torch.bfloat16,
                PER_CHANNEL=group == k)
    if config is None and x2.is_cuda:
        _gemv_tuned[lambda a: (triton.cdiv(n, a["BLOCK_N"]), a["SPLIT_K"])](*args, **meta)
    else:
        c = config or FALLBACK
        if c.kwargs["SPLIT_K"] > 1 and triton.cdiv(n, c.kwargs["BLOCK_N"]) > LOCKS:
            raise ValueError(f"split-K over {triton.cdiv(n, c.kwargs['BLOCK_N'])} row blocks: "
                             f"at most {LOCKS}")
        _gemv_fixed[(triton.cdiv(n, c.kwargs["BLOCK_N"]), c.kwargs["SPLIT_K"])](
            *args, **meta, **c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    return out


__all__ = ["CONFIGS", "FALLBACK", "MAX_M", "fp8_gemv_mma", "mma_gemv_ok"]
