"""y = x @ W.T with W a GGUF block matrix kept quantized (kernels/gguf_dequant.py): the weights
are decoded to float in registers, never written out.

Two kernels (three: Q4_K / Q5_K decode has its own GEMV, kernels/gguf_kquant_gemv.py):
- GEMV (decode, M <= GEMV_MAX_M): each program owns BLOCK_N rows and walks K a chunk of NSB
  blocks at a time; the tile is [BLOCK_N, NSB, 32] per 32-weight group, so block scales are
  decoded once per (row, block) and all loads of a chunk are independent (in flight together).
  Products accumulate element-wise in fp32; one reduction at the end. One program row per x row.
- GEMM (prefill): [BLOCK_M, BLOCK_N] output tiles; per loop step, group g of NSB consecutive
  blocks is decoded to a [BLOCK_N, NSB * 32] tile in x's dtype and multiplied on the tensor cores
  with the matching x columns. With few output tiles (small
  M, narrow N) the K blocks are split over split_k programs that add into an fp32 buffer.
  Q4_K / Q5_K with 16-bit x on CUDA (and under the interpreter with kernel="gemm") take the
  k-quant GEMM of kernels/gguf_kquant_gemm.py instead (about half the instructions per weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.activation import silu_and_mul_triton
from flotilla.kernels.gemm_tile import store_tile
from flotilla.kernels.gemv_rows import check_gated
from flotilla.kernels.gguf_dequant import (
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    dequant_group,
    dequantize_ref,
    gguf_in_features,
    gguf_type,
)
from flotilla.kernels.gguf_iq import iq_grid
from flotilla.kernels.gguf_kquant_gemm import kquant_gemm_config, kquant_gemm_launch, kquant_gemm_ok
from flotilla.kernels.gguf_kquant_gemv import kquant_gemv_triton
from flotilla.kernels.triton_compat import tl, triton

GEMV_MAX_M = 2
_DOT_DTYPES = (torch.float16, torch.bfloat16)


def gguf_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """Dequantize-then-matmul in x's dtype (float32 decode, as gguf.quants does)."""
    return F.linear(x, dequantize_ref(qweight, qtype).to(x.dtype))


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # uint8 [N, row_bytes] blocks
    w16_ptr,  # the same bytes viewed as f16
    grid_ptr,  # float32 IQ grid (kernels/gguf_iq.py iq_grid)
    out_ptr,  # [M, N] in x's dtype
    N,
    K,
    stride_xm,
    stride_wn,  # bytes between weight rows
    stride_om,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,  # weights per block
    TYPE_SIZE: tl.constexpr,  # bytes per block
    BLOCK_N: tl.constexpr,
    NSB: tl.constexpr,  # blocks per loop step
):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_off = rows.to(tl.int64) * stride_wn
    nblocks = K // QK
    sb = tl.arange(0, NSB)
    l = tl.arange(0, 32)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N, NSB, 32], dtype=tl.float32)
    for kb in range(0, nblocks, NSB):
        bidx = kb + sb
        b_ok = bidx < nblocks
        blk = row_off[:, None] + (bidx * TYPE_SIZE)[None, :]
        ok = row_ok[:, None] & b_ok[None, :]
        for g in tl.static_range(QK // 32):
            w = dequant_group(w_ptr, w16_ptr, grid_ptr, blk, ok, g, QTYPE)
            xk = (bidx * QK + g * 32)[:, None] + l[None, :]
            x = tl.load(x_row + xk, mask=b_ok[:, None], other=0.0).to(tl.float32)
            acc += w * x[None, :, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(out_ptr + m * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def dequant_dot_blocks(acc, w_ptr, w16_ptr, grid_ptr, row_off, n_ok, x_rows, row_ok, kb_start,
                       kb_end, QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr, NSB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [rows, BLOCK_N] += x . W^T over GGUF blocks [kb_start, kb_end) of the weight rows at
    byte offsets row_off (the GEMM here and the fused MoE, kernels/gguf_moe.py): NSB blocks a
    step, each group of 32 weights dequantized and fed to one dot."""
    sb = tl.arange(0, NSB)
    l = tl.arange(0, 32)
    for kb in range(kb_start, kb_end, NSB):
        bidx = kb + sb
        b_ok = bidx < kb_end
        blk = row_off[:, None] + (bidx * TYPE_SIZE)[None, :]
        ok = n_ok[:, None] & b_ok[None, :]
        # x columns of group g of blocks bidx, in the order of the reshaped weight tile
        xk = tl.reshape((bidx * QK)[:, None] + l[None, :], [NSB * 32])
        xk_ok = tl.reshape(b_ok[:, None] & (l < 32)[None, :], [NSB * 32])
        for g in tl.static_range(QK // 32):
            w = dequant_group(w_ptr, w16_ptr, grid_ptr, blk, ok, g, QTYPE)
            w = tl.reshape(w, [BLOCK_N, NSB * 32]).to(x_rows.dtype.element_ty)
            x = tl.load(x_rows + (xk + g * 32)[None, :], mask=row_ok[:, None] & xk_ok[None, :],
                        other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # uint8 [N, row_bytes] blocks
    w16_ptr,  # the same bytes viewed as f16
    grid_ptr,  # float32 IQ grid (kernels/gguf_iq.py iq_grid)
    out_ptr,  # [M, N]: x's dtype, or fp32 (zero-filled) when split_k > 1
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    split_k,  # programs sharing one output tile, each a run of K
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NSB: tl.constexpr,  # blocks per loop step: one dot covers NSB * 32 weights per group
    ATOMIC: tl.constexpr,  # split_k > 1: fp32 atomics into a zero-filled out
    DOT_PRECISION: tl.constexpr,  # for float32 x: "tf32" or "ieee"
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    nblocks = K // QK
    per_split = tl.cdiv(nblocks, split_k)
    kb_start = pid_k * per_split
    kb_end = tl.minimum(kb_start + per_split, nblocks)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    row_off = rn.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = dequant_dot_blocks(acc, w_ptr, w16_ptr, grid_ptr, row_off, n_ok, x_rows, m_ok,
                             kb_start, kb_end, QTYPE, QK, TYPE_SIZE, BLOCK_N, NSB,
                             DOT_PRECISION)
    store_tile(out_ptr, acc, rm, rn, m_ok, n_ok, stride_om, ATOMIC)


def _check(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> int:
    k = gguf_in_features(qweight, qtype)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the {gguf_type(qtype).name} weight {k}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.stride(1) != 1:
        raise ValueError("qweight must be uint8 [N, row_bytes] with contiguous rows")
    if qweight.stride(0) % 2 or qweight.storage_offset() % 2:
        raise ValueError("qweight rows must start at even byte offsets (f16 fields)")
    if x.dtype not in (torch.float32, *_DOT_DTYPES):
        raise ValueError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    return k


def _gemm_tiles(x: torch.Tensor, m: int, n: int, block_m: int | None, block_n: int | None
                ) -> tuple[int, int]:
    """GPU tiles; CPU tensors only run under the Triton interpreter, whose cost is per operation,
    not per element, so there one program takes (nearly) the whole matrix."""
    if not x.is_cuda:
        return (block_m or min(triton.next_power_of_2(m), 256),
                block_n or min(triton.next_power_of_2(n), 1024))
    return block_m or (16 if m <= 16 else 32 if m <= 32 else 64), block_n or 64


def gemm_config(qtype: int) -> tuple[int, int]:
    """GPU GEMM: (NSB blocks per step (dot K = NSB * 32), num_warps). The 16-weight-sub-block
    k-quants decode two scales per group: one block per step and 8 warps keep them in registers."""
    if int(qtype) in (Q2_K, Q3_K, Q6_K):
        return 1, 8
    return (2 if gguf_type(qtype).qk == 256 else 4), 4


def use_gemv(x: torch.Tensor, m: int, kernel: str | None) -> bool:
    """kernel None: the GEMV for decode-sized M on a GPU (the interpreter is faster with one
    GEMM program); "gemv" / "gemm" force one (tests)."""
    if kernel not in (None, "gemv", "gemm"):
        raise ValueError(f"kernel must be None, 'gemv' or 'gemm', got {kernel!r}")
    return kernel == "gemv" or (kernel is None and x.is_cuda and m <= GEMV_MAX_M)


def split_k_for(x: torch.Tensor, tiles: int, steps: int, split_k: int | None) -> int:
    """Enough programs to fill the GPU when the output has few tiles (small M, narrow N)."""
    if split_k is None:
        if not x.is_cuda:
            return 1
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        split_k = max(1, min(steps // 4, 2 * sms // tiles)) if tiles < sms else 1
    return max(1, min(split_k, steps))


def gguf_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qtype: int,
    kernel: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    split_k: int | None = None,
    gated: bool = False,
    pdl: str = "auto",
) -> torch.Tensor:
    """x [..., K] @ dequant(qweight [N, row_bytes]).T -> [..., N] in x's dtype. `kernel`,
    block sizes and split_k override the defaults (tests, tuning). gated: the weight is [gate;
    up] and the result silu(gate) * up [..., N / 2], fused into the K-quant GEMV when it runs
    (launched under the selection's `pdl` mode)."""
    k = _check(x, qweight, qtype)
    t = gguf_type(qtype)
    n = qweight.shape[0]
    check_gated(n, gated)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    w16 = qweight.view(torch.float16)
    if m == 0:
        return x.new_empty(*x.shape[:-1], n // 2 if gated else n)
    if use_gemv(x, m, kernel) and int(qtype) in (Q4_K, Q5_K) and block_n is None:
        return kquant_gemv_triton(x2, qweight, qtype, gated=gated, pdl=pdl).reshape(
            *x.shape[:-1], -1)
    if gated:
        return silu_and_mul_triton(gguf_matmul_triton(x, qweight, qtype, kernel, block_m,
                                                      block_n, split_k))
    if use_gemv(x, m, kernel):
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        bn = block_n or 8
        nsb = 8 if t.qk == 256 else 32
        _gemv_kernel[(triton.cdiv(n, bn), m)](
            x2, qweight, w16, iq_grid(qtype, x.device, w16), out, n, k, x2.stride(0),
            qweight.stride(0), out.stride(0),
            QTYPE=int(qtype), QK=t.qk, TYPE_SIZE=t.type_size, BLOCK_N=bn, NSB=nsb, num_warps=4,
        )
        return out.reshape(*x.shape[:-1], n)
    nblocks = k // t.qk
    if kquant_gemm_ok(x, qweight, qtype) and (x.is_cuda or kernel == "gemm"):
        # Q4_K / Q5_K: kernels/gguf_kquant_gemm.py (the interpreter runs it when forced)
        bm, bn, warps = kquant_gemm_config(m)
        bm, bn = (block_m or bm, block_n or bn) if x.is_cuda else _gemm_tiles(
            x, m, n, block_m, block_n)
        split_k = split_k_for(x, triton.cdiv(m, bm) * triton.cdiv(n, bn), nblocks, split_k)
        out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1
               else torch.empty(m, n, dtype=x.dtype, device=x.device))
        kquant_gemm_launch(x2, qweight, qtype, out, bm, bn, split_k, warps)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
    bm, bn = _gemm_tiles(x, m, n, block_m, block_n)
    nsb, warps = gemm_config(qtype)
    if not x.is_cuda:
        # tiles of at most 2**20 elements (a Triton limit)
        nsb = min(triton.next_power_of_2(nblocks), 4 if t.qk == 256 else 32,
                  (1 << 15) // max(bm, bn))
    split_k = split_k_for(x, triton.cdiv(m, bm) * triton.cdiv(n, bn), nblocks, split_k)
    if split_k > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)
    _gemm_kernel[grid](
        x2, qweight, w16, iq_grid(qtype, x.device, w16), out, m, n, k, x2.stride(0),
        qweight.stride(0), out.stride(0), split_k,
        QTYPE=int(qtype), QK=t.qk, TYPE_SIZE=t.type_size, BLOCK_M=bm, BLOCK_N=bn, NSB=nsb,
        ATOMIC=split_k > 1, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=2,
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
