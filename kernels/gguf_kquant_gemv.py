"""Decode GEMV for Q4_K / Q5_K blocks: y[m] = x[m] @ W.T with W kept quantized.

Why a kernel of its own (the generic GEMV in kernels/gguf_matmul.py decodes one 32-weight group
at a time): a Q4_K super-block stores its 256 codes as four 32-byte runs, run p holding sub-block
2p in the low nibbles and 2p + 1 in the high ones. This kernel loads all runs of NSB blocks as one
[BLOCK_N, NSB, 4, 32] byte tile (16-byte loads), dots the low and high nibbles with two x tiles
loaded once per step, and only then applies the sub-block scale and min:

    sum_k w_k x_k = d * sc_j * sum_l q_l x_l  -  dmin * m_j * sum_l x_l     (per sub-block j)

so per weight it costs a nibble extract, an OR + subtract (u4_to_f32: no int-to-float convert)
and one FMA. Q5_K adds its fifth bit from the 32-byte qh run (bit j of byte l belongs to
sub-block j). The tile (BLOCK_N, NSB, warps) is autotuned per (N, K, type) on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gguf_dequant import Q4_K, Q5_K, gguf_type, u4_to_f32
from kernels.tuning import warmup_autotune


@triton.jit
def _scale_min(u8_ptr, blk, mask, j):
    """6-bit scale and min of sub-blocks j (int tensor broadcastable to blk) as float32."""
    a = tl.load(u8_ptr + blk + 4 + j, mask=mask, other=0).to(tl.int32)
    c = tl.load(u8_ptr + blk + 8 + j, mask=mask, other=0).to(tl.int32)
    e = tl.load(u8_ptr + blk + j, mask=mask, other=0).to(tl.int32)
    low = j < 4
    sc = tl.where(low, a & 63, (c & 15) | ((e >> 6) << 4))
    mn = tl.where(low, c & 63, (c >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _kquant_gemv_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # uint8 [N, row_bytes] Q4_K / Q5_K blocks
    w16_ptr,  # the same bytes viewed as f16
    out_ptr,  # [M, N] in x's dtype
    N,
    K,
    stride_xm,
    stride_wn,  # bytes between weight rows
    stride_om,
    FIVE_BITS: tl.constexpr,  # Q5_K
    TYPE_SIZE: tl.constexpr,  # 144 (Q4_K) or 176 (Q5_K)
    BLOCK_N: tl.constexpr,
    NSB: tl.constexpr,  # super-blocks per loop step
):
    QS: tl.constexpr = 48 if FIVE_BITS else 16  # offset of the 4-bit runs
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_off = rows.to(tl.int64) * stride_wn
    nblocks = K // 256
    sb = tl.arange(0, NSB)
    p = tl.arange(0, 4)
    l = tl.arange(0, 32)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N, NSB, 4], dtype=tl.float32)
    for kb in range(0, nblocks, NSB):
        bidx = kb + sb
        b_ok = bidx < nblocks
        blk = row_off[:, None] + (bidx * TYPE_SIZE)[None, :]  # [BN, NSB]
        ok = row_ok[:, None] & b_ok[None, :]
        blk3 = blk[:, :, None]
        ok3 = ok[:, :, None]
        blk4 = blk3[:, :, :, None]
        ok4 = ok3[:, :, :, None]
        runs = tl.load(w_ptr + blk4 + QS + (p * 32)[None, None, :, None] + l[None, None, None, :],
                       mask=ok4, other=0).to(tl.int32)  # [BN, NSB, 4, 32]
        lo = runs & 15  # sub-block 2p
        hi = runs >> 4  # sub-block 2p + 1
        if FIVE_BITS:
            qh = tl.load(w_ptr + blk4 + 16 + l[None, None, None, :], mask=ok4,
                         other=0).to(tl.int32)  # [BN, NSB, 1, 32]
            lo = lo | (((qh >> (2 * p)[None, None, :, None]) & 1) << 4)
            hi = hi | (((qh >> (2 * p + 1)[None, None, :, None]) & 1) << 4)
        xk = (bidx * 256)[:, None, None] + (p * 64)[None, :, None] + l[None, None, :]
        x_ok = b_ok[:, None, None]
        x_lo = tl.load(x_row + xk, mask=x_ok, other=0.0).to(tl.float32)  # [NSB, 4, 32]
        x_hi = tl.load(x_row + xk + 32, mask=x_ok, other=0.0).to(tl.float32)
        # 0..31 fit the mantissa trick as well as 0..15
        dot_lo = tl.sum(u4_to_f32(lo) * x_lo[None, :, :, :], axis=3)  # [BN, NSB, 4]
        dot_hi = tl.sum(u4_to_f32(hi) * x_hi[None, :, :, :], axis=3)
        d = tl.load(w16_ptr + blk3 // 2, mask=ok3, other=0.0).to(tl.float32)
        dmin = tl.load(w16_ptr + blk3 // 2 + 1, mask=ok3, other=0.0).to(tl.float32)
        j = (2 * p)[None, None, :]
        sc_lo, mn_lo = _scale_min(w_ptr, blk3, ok3, j)
        sc_hi, mn_hi = _scale_min(w_ptr, blk3, ok3, j + 1)
        acc += d * (sc_lo * dot_lo + sc_hi * dot_hi) \
            - dmin * (mn_lo * tl.sum(x_lo, axis=2)[None, :, :]
                      + mn_hi * tl.sum(x_hi, axis=2)[None, :, :])
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(out_ptr + m * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


# tiles tried on the device (keyed on N, K, type): 2-16 rows, 2-8 super-blocks per step
GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "NSB": nsb}, num_warps=w)
    for bn, nsb, w in ((8, 8, 4), (4, 8, 4), (16, 4, 4), (8, 4, 4), (4, 4, 2), (16, 8, 8),
                       (2, 8, 4), (8, 2, 2))
]
_kquant_gemv_tuned = warmup_autotune(GEMV_CONFIGS, ["N", "K", "FIVE_BITS"])(
    _kquant_gemv_kernel)


def kquant_gemv_triton(x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                       block_n: int | None = None, nsb: int = 8) -> torch.Tensor:
    """x [M, K] (small M; one program row per x row) @ dequant(qweight).T -> [M, N]. On CUDA
    without a pinned block_n the tile is autotuned (before any CUDA-graph capture)."""
    if int(qtype) not in (Q4_K, Q5_K):
        raise ValueError("kquant_gemv_triton decodes Q4_K and Q5_K only")
    t = gguf_type(qtype)
    n, k = qweight.shape[0], qweight.shape[1] // t.type_size * 256
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {k}] with unit stride along K")
    if qweight.dtype != torch.uint8 or qweight.stride(1) != 1 or qweight.stride(0) % 2:
        raise ValueError("qweight must be uint8 [N, row_bytes], rows contiguous, even stride")
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    args = (x, qweight, qweight.view(torch.float16), out, n, k, x.stride(0), qweight.stride(0),
            out.stride(0))
    meta = dict(FIVE_BITS=int(qtype) == Q5_K, TYPE_SIZE=t.type_size)
    if x.is_cuda and block_n is None:
        _kquant_gemv_tuned[lambda a: (triton.cdiv(n, a["BLOCK_N"]), x.shape[0])](*args, **meta)
    else:
        bn = block_n or 8
        _kquant_gemv_kernel[(triton.cdiv(n, bn), x.shape[0])](*args, **meta, BLOCK_N=bn,
                                                              NSB=nsb, num_warps=4)
    return out
