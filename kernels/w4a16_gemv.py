"""4-bit (GPTQ / AWQ, kernels/w4a16.py layout) decode GEMV on the tensor cores, M <= 2.

Modelled on kernels/fp8_gemv.py: each [BLOCK_N, BLOCK_K] weight tile becomes 16-bit values in
registers and meets the x tile (padded to 16 rows, zeros known at compile time) in
`tl.dot(W16, x16.T)` (wgmma on sm90), summing in fp32.
- Codes to 16-bit with one LOP3 per two weights: a nibble pair OR-ed into the mantissa of
  OFFSET (fp16 1024 / bf16 128, where the mantissa's last bits are units) gives the exact
  values OFFSET + code in x's dtype, so x is used as it comes (no fp16 range rescale) and the
  products are exact. One asm block turns a word into its four pairs (codes i and i + 4, a
  shift and a LOP3 each; `_PAIRS_ASM`, tied to its interpreter form `_pair_plain` by
  tests/kernels/test_inline_asm.py).
- No per-weight subtract or scale: per (row n, group g) the tile gives
  d = sum (OFFSET + code) x, and sum (code - z) x = d - (OFFSET + z) * sum(x). The loop keeps
  acc += s_g * d (group scales; per-channel: plain accumulation, scaled at the end); the
  correction sum_g s_g (OFFSET + z_g) X_g, with X_g the sum of x over the slice's part of group
  g, is computed once after the loop (`_offsets`), [BLOCK_N] per x row, off the weight loop.
- K order inside a tile (as fp8_gemv's `_logical_k`): the dot is a sum over K, so the pairs
  are placed where each thread's wgmma fragment wants them: the 4 threads sharing a fragment
  row (c = lane % 4) each read one contiguous quarter of the tile's words (16 bytes per row
  for BLOCK_K = 128) and x is gathered in the same order (`_x_offsets`).
- Split-K (SPLIT_K > 1) with a per-row-block counter, the last slice adding the partials and
  resetting it (one launch), as kernels/fp8_gemv.py.
BLOCK_K divides the group (or the group is K); the tile, stages, warps and SPLIT_K are
autotuned per (N, K, group) on CUDA.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.tuning import warmup_autotune

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_M = 2  # rows of x (the dot pads them to 16 columns)
LOCKS = 4096  # split-K counters per device: row blocks of one launch
F16_OFFSET = tl.constexpr(1024.0)  # 0x6400: mantissa unit 1
BF16_OFFSET = tl.constexpr(128.0)  # 0x4300: mantissa unit 1


def _pairs_asm(magic: int) -> str:
    """Word $4 (its copy $5 unused) -> $0..$3: packed 16-bit pairs (magic | code i,
    magic | code i + 4) = (OFFSET + code i, OFFSET + code i + 4), i = 0..3. lop3 0xEA:
    (a & b) | c."""
    lines = [f"lop3.b32 $0, $4, 0x000F000F, {magic:#x}, 0xEA;"]
    for i in (1, 2, 3):
        lines += [f"shr.u32 t, $4, {4 * i};", f"lop3.b32 ${i}, t, 0x000F000F, {magic:#x}, 0xEA;"]
    return "{\n.reg .b32 t;\n" + "\n".join(lines) + "\n}\n"


_PAIRS_ASM_F16 = tl.constexpr(_pairs_asm(0x64006400))
_PAIRS_ASM_BF16 = tl.constexpr(_pairs_asm(0x43004300))


@triton.jit
def _pair_plain(q, i: tl.constexpr, OFFSET: tl.constexpr, DT: tl.constexpr):
    """Codes i and i + 4 of each word as OFFSET + code in DT, joined on a new last axis (the
    interpreter's form of the asm)."""
    lo = ((q >> (4 * i)) & 15).to(tl.float32) + OFFSET
    hi = ((q >> (4 * i + 16)) & 15).to(tl.float32) + OFFSET
    return tl.join(lo, hi).to(DT)


@triton.jit
def _w_tile(q, DT: tl.constexpr, OFFSET: tl.constexpr, USE_ASM: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Words [BLOCK_N, BLOCK_K / 8] -> DT [BLOCK_N, BLOCK_K] (OFFSET + code) in the dot's K
    order: dot column 32u + 16 * (i // 2) + 8 * (i % 2) + 2c + e holds code i + 4e of word
    c * BLOCK_K / 32 + u (see _x_offsets)."""
    if USE_ASM:
        if DT == tl.float16:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _PAIRS_ASM_F16, "=r,=r,=r,=r,r,r", [tl.join(q, q)], dtype=(tl.float16,) * 4,
                is_pure=True, pack=2)
        else:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _PAIRS_ASM_BF16, "=r,=r,=r,=r,r,r", [tl.join(q, q)], dtype=(tl.bfloat16,) * 4,
                is_pure=True, pack=2)
    else:
        o0, o1 = _pair_plain(q, 0, OFFSET, DT), _pair_plain(q, 1, OFFSET, DT)
        o2, o3 = _pair_plain(q, 2, OFFSET, DT), _pair_plain(q, 3, OFFSET, DT)
    t = tl.join(tl.join(o0, o1), tl.join(o2, o3))  # [BLOCK_N, words, e, i % 2, i // 2]
    t = tl.reshape(t, [BLOCK_N, 4, BLOCK_K // 32, 2, 2, 2])  # words -> (c, u)
    t = tl.permute(t, [0, 2, 5, 4, 1, 3])  # (u, i // 2, i % 2, c, e)
    return tl.reshape(t, [BLOCK_N, BLOCK_K])


@triton.jit
def _x_offsets(BLOCK_K: tl.constexpr):
    """Memory column (within the tile) of each dot column: the inverse of _w_tile's order."""
    d = tl.arange(0, BLOCK_K)
    u, i2, i1, c, e = d // 32, d // 16 % 2, d // 8 % 2, d // 2 % 4, d % 2
    return 8 * (c * (BLOCK_K // 32) + u) + i1 + 2 * i2 + 4 * e


@triton.jit
def _x_rows(x_ptr, perm_ptr, M, stride_xm, k, k_hi, BLOCK_M: tl.constexpr,
            HAS_PERM: tl.constexpr):
    """Rows 0 and 1 of x at kernel columns k (through perm; zeros past k_hi or M; row 1 is
    row 0 if BLOCK_M == 1)."""
    ok = k < k_hi
    if HAS_PERM:
        k = tl.load(perm_ptr + k, mask=ok, other=0)
    x0 = tl.load(x_ptr + k, mask=ok, other=0.0)
    if BLOCK_M == 2:
        x1 = tl.load(x_ptr + stride_xm + k, mask=ok & (M > 1), other=0.0)
    else:
        x1 = x0
    return x0, x1


@triton.jit
def _x_tile(x0, x1, BLOCK_M: tl.constexpr):
    """The dot's x operand [16, BLOCK_K] in x's dtype: rows 0 and 1 (< BLOCK_M), the padding
    rows zeros known at compile time."""
    rm16 = tl.arange(0, 16)[:, None]
    x16 = tl.where(rm16 == 0, x0[None, :], tl.zeros_like(x0)[None, :])
    if BLOCK_M == 2:
        x16 = tl.where(rm16 == 1, x1[None, :], x16)
    return x16


@triton.jit
def _tile_dot(acc, q, x16, s, DT: tl.constexpr, OFFSET: tl.constexpr, USE_ASM: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """acc [BLOCK_N, 16] += (OFFSET + codes) . x tile [* group scales s], fp32 sums."""
    w16 = _w_tile(q, DT, OFFSET, USE_ASM, BLOCK_N, BLOCK_K)
    if PER_CHANNEL:
        acc = tl.dot(w16, tl.trans(x16), acc)
    else:
        acc += tl.dot(w16, tl.trans(x16)) * s[:, None]
    return acc


@triton.jit
def _offsets(x_ptr, perm_ptr, s_rows, z_rows, M, stride_xm, k_lo, k_hi, GROUP: tl.constexpr,
             OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, HAS_PERM: tl.constexpr,
             PER_CHANNEL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """What the dot added beyond sum (code - z) x, float32 [BLOCK_N] for x rows 0 and 1:
    sum over the slice's BLOCK_K-wide sub-tiles t (each in one group g) of
    s_g (OFFSET + z_g) sum_{k in t} x[k]; per-channel (OFFSET + z) sum_k x[k] (unscaled, as
    the accumulator). 2048 columns a step: [tiles, BLOCK_K] x sums, then [BLOCK_N, tiles]."""
    NT: tl.constexpr = 2048 // BLOCK_K if BLOCK_K < 2048 else 1
    j = tl.arange(0, NT)
    kk = tl.arange(0, BLOCK_K)
    b0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    b1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in range(k_lo, k_hi, NT * BLOCK_K):
        t0 = c0 + j * BLOCK_K
        x0, x1 = _x_rows(x_ptr, perm_ptr, M, stride_xm, t0[:, None] + kk[None, :], k_hi,
                         BLOCK_M, HAS_PERM)
        a0 = tl.sum(x0.to(tl.float32), axis=1)
        a1 = tl.sum(x1.to(tl.float32), axis=1)
        if PER_CHANNEL:
            b0 += tl.sum(a0, axis=0)
            b1 += tl.sum(a1, axis=0)
        else:
            g = (t0 // GROUP)[None, :]
            t_ok = (t0 < k_hi)[None, :]
            s = tl.load(s_rows[:, None] + g, mask=t_ok, other=0.0).to(tl.float32)
            z = tl.load(z_rows[:, None] + g, mask=t_ok, other=0).to(tl.float32)
            sz = s * (OFFSET + z)
            b0 += tl.sum(sz * a0[None, :], axis=1)
            b1 += tl.sum(sz * a1[None, :], axis=1)
    if PER_CHANNEL:
        z = OFFSET + tl.load(z_rows).to(tl.float32)
        b0 = b0 * z
        b1 = b1 * z
    return b0, b1


@triton.jit
def _w4_gemv_mma_kernel(
    x_ptr,  # [M, K] bf16 or fp16 activations, unit stride along K
    q_ptr,  # int32 [N, K // 8] (kernels/w4a16.py layout)
    s_ptr,  # fp16 [N, K // group] scales
    z_ptr,  # uint8 [N, K // group] zero points (the scales' strides)
    perm_ptr,  # int32 [K]: kernel column k reads x[perm[k]] (HAS_PERM)
    out_ptr,  # [M, N] in x's dtype
    ws_ptr,  # float32 [SPLIT_K, M, N] partials (SPLIT_K > 1)
    lock_ptr,  # int32 [>= cdiv(N, BLOCK_N)] zeroed counters (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_q,
    stride_s,
    stride_om,
    GROUP: tl.constexpr,  # the group size (K: per-channel); constexpr: a shift, not a division
    BLOCK_M: tl.constexpr,  # 1 or 2: the next power of two of M
    HAS_PERM: tl.constexpr,
    USE_ASM: tl.constexpr,  # CUDA: codes by inline PTX (the interpreter runs no asm)
    PER_CHANNEL: tl.constexpr,  # group == K: one scale per row, applied to the result
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masked last tile
    BLOCK_N: tl.constexpr,  # weight rows per program: 64 per warpgroup of 4 warps
    BLOCK_K: tl.constexpr,  # K per step: a multiple of 32 dividing the group (group scales)
    SPLIT_K: tl.constexpr,  # K slices (programs along axis 1)
):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    OFFSET: tl.constexpr = F16_OFFSET if DT == tl.float16 else BF16_OFFSET
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rn_c = tl.minimum(rn, N - 1)  # clamped: loads stay unmasked, stores are masked
    q_rows = q_ptr + rn_c.to(tl.int64)[:, None] * stride_q
    offs_w = tl.arange(0, BLOCK_K // 8)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    if EVEN_K:
        k_end = k_hi
    else:
        k_end = k_lo + tl.maximum(k_hi - k_lo, 0) // BLOCK_K * BLOCK_K
    # x rows (and group scales) are prefetched one step ahead in registers: too narrow for
    # the cp.async pipeline of the words; x is gathered in the dot's K order
    offs_x = _x_offsets(BLOCK_K)
    x0, x1 = _x_rows(x_ptr, perm_ptr, M, stride_xm, k_lo + offs_x, k_hi, BLOCK_M, HAS_PERM)
    s_rows = s_ptr + rn_c * stride_s
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    if not PER_CHANNEL:
        s = tl.load(s_rows + k_lo // GROUP, mask=k_lo < k_hi, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(k_lo, k_end, BLOCK_K):
        q = tl.load(q_rows + (k0 // 8 + offs_w)[None, :])
        x16 = _x_tile(x0, x1, BLOCK_M)
        acc = _tile_dot(acc, q, x16, s, DT, OFFSET, USE_ASM, BLOCK_N, BLOCK_K, PER_CHANNEL)
        k_next = k0 + BLOCK_K
        x0, x1 = _x_rows(x_ptr, perm_ptr, M, stride_xm, k_next + offs_x, k_hi, BLOCK_M,
                         HAS_PERM)
        if not PER_CHANNEL:
            s = tl.load(s_rows + k_next // GROUP, mask=k_next < k_hi, other=0.0).to(tl.float32)
    if not EVEN_K:
        if k_end < k_hi:  # the last, partial tile (per-channel scales only); x0, x1 hold it
            words = k_end // 8 + offs_w
            q = tl.load(q_rows + words[None, :], mask=(words < k_hi // 8)[None, :], other=0)
            x16 = _x_tile(x0, x1, BLOCK_M)
            acc = _tile_dot(acc, q, x16, s, DT, OFFSET, USE_ASM, BLOCK_N, BLOCK_K, PER_CHANNEL)
    b0, b1 = _offsets(x_ptr, perm_ptr, s_rows, z_ptr + rn_c * stride_s, M, stride_xm, k_lo,
                      k_hi, GROUP, OFFSET, BLOCK_M, HAS_PERM, PER_CHANNEL, BLOCK_N, BLOCK_K)
    rm16 = tl.arange(0, 16)
    acc -= tl.where(rm16[None, :] == 0, b0[:, None], tl.where(rm16[None, :] == 1, b1[:, None],
                                                                0.0))
    if PER_CHANNEL:
        acc = acc * tl.load(s_rows).to(tl.float32)[:, None]
    mask = n_ok[:, None] & (rm16 < M)[None, :]
    out_ptrs = out_ptr + rm16[None, :] * stride_om + rn[:, None]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws_rows = ws_ptr + rm16[None, :] * N + rn[:, None]
        tl.store(ws_rows + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last slice of this row block: add the partials
            total = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):  # .cg: not the L1's copy from an older launch
                total += tl.load(ws_rows + i * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0)


def _config(bn: int, bk: int, split: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=warps,
                         num_stages=stages)


# 64 rows per warpgroup (wgmma's M); 4-16 KiB of words per stage; BLOCK_K 128 (groups of 128),
# 256 for per-channel scales, 64 for groups of 64; split-K 2-8 for the narrow matrices
# (Llama-3-8B o / down: 32 row blocks of 128 on 132 SMs). SASS per weight in the loop (sm_90,
# bf16 x, `python -m tests.quant.sm90_compile w4loop`): 1.6-2.0 (BLOCK_K 128+, BLOCK_N 128+),
# 2.3-2.7 (BLOCK_N 64 or BLOCK_K 64); 0.5 of it the LOP3s, 0.375 the shifts
CONFIGS = [
    _config(128, 128, 1, 4, 4),
    _config(256, 128, 1, 8, 4),
    _config(64, 128, 1, 4, 4),
    _config(128, 256, 1, 4, 3),
    _config(128, 128, 2, 4, 4),
    _config(256, 128, 2, 8, 3),
    _config(64, 128, 2, 4, 4),
    _config(128, 128, 4, 4, 4),
    _config(64, 128, 4, 4, 4),
    _config(128, 128, 8, 4, 4),
    _config(128, 64, 1, 4, 6),  # groups of 64
    _config(128, 64, 2, 4, 6),
    _config(128, 64, 4, 4, 6),
]
# groups of 32 (~6.5 instructions per weight on sm_90: the dispatch keeps the CUDA-core GEMV of
# kernels/w4a16.py for them); the interpreter
FALLBACK = _config(64, 32, 1, 4, 3)
_SPLIT_MAX = max(c.kwargs["SPLIT_K"] for c in CONFIGS)


def _prune(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
           ) -> list[triton.Config]:
    """Group scales need BLOCK_K | group; a partial last tile BLOCK_K <= 128; split-K needs
    >= 2 tiles per slice and few row blocks (not more than the counters)."""
    # the autotuner passes positional arguments in named_args and constexprs in kwargs
    k, group = named_args["K"], kwargs.get("GROUP", named_args.get("GROUP"))
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


_gemv_fixed = triton.heuristics({"EVEN_K": _even_k})(_w4_gemv_mma_kernel)
_gemv_tuned = warmup_autotune(CONFIGS, ["N", "K", "GROUP", "HAS_PERM"],
                              prune_configs_by={"early_config_prune": _prune})(_gemv_fixed)
_locks: dict[torch.device, torch.Tensor] = {}


def _lock_buffer(device: torch.device) -> torch.Tensor:
    """Zeroed split-K counters of a device (every launch leaves them at 0)."""
    if device not in _locks:
        _locks[device] = torch.zeros(LOCKS, dtype=torch.int32, device=device)
    return _locks[device]


def w4_mma_ok(x: torch.Tensor, k: int, group: int) -> bool:
    """Where the dispatch picks the tensor-core GEMV: 16-bit x and per-channel scales or groups
    of a multiple of 64 (w4a16_gemv_mma also takes groups of 32, at BLOCK_K = 32: slower than
    the CUDA-core GEMV)."""
    return x.dtype in (torch.float16, torch.bfloat16) and (group == k or group % 64 == 0)


def w4a16_gemv_mma(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor, group: int, perm: torch.Tensor | None = None,
                   config: triton.Config | None = None) -> torch.Tensor:
    """x2 [M, K] (16-bit, unit stride along K, M <= MAX_M) @ dequant(qweight).T -> [M, N] in
    x2's dtype (shapes as checked by kernels/w4a16.py). `config` pins one tile config (tests);
    otherwise CUDA autotunes and the interpreter runs FALLBACK."""
    m, k = x2.shape
    n = qweight.shape[0]
    if (m > MAX_M or x2.dtype not in (torch.float16, torch.bfloat16) or x2.stride(1) != 1
            or (group != k and group % 32)):
        raise ValueError(f"w4a16_gemv_mma takes <= {MAX_M} 16-bit rows with unit stride and "
                         f"group == K or a multiple of 32, got {tuple(x2.shape)} {x2.dtype} "
                         f"group {group}")
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    split = _SPLIT_MAX if config is None else config.kwargs["SPLIT_K"]
    ws = torch.empty(split if split > 1 else 0, m, n, dtype=torch.float32, device=x2.device)
    locks = _lock_buffer(x2.device)
    args = (x2, qweight, scales, zeros, qweight if perm is None else perm, out, ws, locks, m, n,
            k, x2.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
    meta = dict(GROUP=group, BLOCK_M=triton.next_power_of_2(m), HAS_PERM=perm is not None,
                USE_ASM=x2.is_cuda and not _INTERPRET, PER_CHANNEL=group == k)
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


__all__ = ["CONFIGS", "FALLBACK", "MAX_M", "w4_mma_ok", "w4a16_gemv_mma"]
