"""4-bit weight x 16-bit activation matmul (GPTQ / AWQ checkpoints after loading).

Layout (both formats are repacked into it at load time, services/engine/quant/w4a16.py, where
K or the group is not a multiple of 64; otherwise into kernels/w4a16_marlin.py's re-packed
layout, which `w4a16_matmul_triton(..., marlin=True)` serves):
- qweight int32 [N, K // 8]: word w of row n holds weights k = 8w .. 8w+7, weight 8w+i in bits
  4i .. 4i+3 (the GPTQ order along K, transposed so each output row is contiguous);
- scales fp16 [N, K // G] and zeros uint8 [N, K // G]: w[n, k] = (q - zero) * scale of group k // G;
- perm int32 [K] or None (GPTQ act-order): the checkpoint's K order was sorted by group at load
  time, so kernel position k multiplies x[perm[k]].

Codes become floats with one instruction each (_codes8 via kernels/code_floats.py: a byte
permute puts a nibble into the mantissa of 0.5f, giving 0.5 + code / 256). A decode GEMV on
sm_90 is bound by instruction issue, not bandwidth, unless it spends about 2-4 instructions per
4-bit weight.
A tensor-core GEMV (fp8_gemv.py's structure, 1.6-2.0 instructions per weight) measured slower
than a CUDA-core GEMV on an H100 (27-55% vs 35-61% of copy bandwidth on Llama-3-8B's matrices,
GPTQ B1 272 vs 291 tok/s) and was removed (git history: f7768a7).
GEMV (one x row on a GPU, kernels/gguf_matmul.py: use_gemv; groups a multiple of 64):
kernels/w4a16_gemv.py, lanes along K with 16-byte vector loads, ~2.5-3 instructions a weight.
GEMM: per step of BLOCK_K (dividing the group) weights, codes are scaled with one FMA each
(f * 256s - (128 + z)s), cast to x's dtype and fed to tl.dot; split_k as in kernels/gguf_matmul.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.activation import silu_and_mul_triton
from flotilla.kernels.code_floats import INTERPRET, codes4
from flotilla.kernels.gemm_tile import store_tile
from flotilla.kernels.gemv_rows import check_gated
from flotilla.kernels.gguf_matmul import _gemm_tiles, split_k_for, use_gemv
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.w4a16_gemv import gemv_ok, w4a16_gemv
from flotilla.kernels.w4a16_marlin import marlin_ok, w4a16_marlin
from flotilla.kernels.w4a16_mma import mma_ok, w4a16_mma


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15, K % 8 == 0) -> int32 [N, K // 8] in the layout above."""
    n, k = codes.shape
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int32)
    words = (codes.reshape(n, k // 8, 8).to(torch.int32) << shifts).sum(-1, dtype=torch.int64)
    return words.to(torch.int32)  # wraps the top nibble into the sign bit, as intended


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] -> uint8 codes [N, K]."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    return ((qweight[:, :, None] >> shifts) & 15).reshape(qweight.shape[0], -1).to(torch.uint8)


def w4a16_dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """Float32 [N, K] in kernel order (apply perm to x, not here)."""
    q = unpack_int4(qweight).float()
    z = zeros.float().repeat_interleave(group_size, dim=1)[:, : q.shape[1]]
    s = scales.float().repeat_interleave(group_size, dim=1)[:, : q.shape[1]]
    return (q - z) * s


def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None = None
                     ) -> torch.Tensor:
    w = w4a16_dequantize_ref(qweight, scales, zeros, group_size).to(x.dtype)
    return F.linear(x if perm is None else x[..., perm], w)


@triton.jit
def _codes8(q, USE_ASM: tl.constexpr):
    """int32 words -> 8 tensors of their shape, code j as 0.5 + code / 256: the low and the
    high nibbles of every byte are masked out once per word, then one PRMT a code."""
    c0, c2, c4, c6 = codes4(q & 0x0F0F0F0F, USE_ASM)
    c1, c3, c5, c7 = codes4((q >> 4) & 0x0F0F0F0F, USE_ASM)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_q, stride_s, stride_om,
    group_size,
    split_k,  # programs sharing one output tile, each a run of K
    HAS_PERM: tl.constexpr,
    USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a power of two dividing the group size
    ATOMIC: tl.constexpr,  # split_k > 1: fp32 atomics into a zero-filled out
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    BW: tl.constexpr = BLOCK_K // 8
    offs_w = tl.arange(0, BW)
    offs_k = tl.arange(0, BLOCK_K)
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, split_k)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, steps)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(first, last):
        words = step * BW + offs_w
        q = tl.load(q_ptr + rn[:, None] * stride_q + words[None, :], mask=n_ok[:, None], other=0)
        f0, f1, f2, f3, f4, f5, f6, f7 = _codes8(q, USE_ASM)
        grp = rn * stride_s + (step * BLOCK_K) // group_size  # BLOCK_K divides the group
        s = tl.load(s_ptr + grp, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + grp, mask=n_ok, other=0).to(tl.float32)
        # (code - zero) * scale = f * 256 * scale - (128 + zero) * scale: one FMA a weight
        a = (256.0 * s)[:, None]
        b = ((128.0 + z) * s)[:, None]
        dt = x_ptr.dtype.element_ty
        lo = tl.join(tl.join((f0 * a - b).to(dt), (f4 * a - b).to(dt)),
                     tl.join((f2 * a - b).to(dt), (f6 * a - b).to(dt)))
        hi = tl.join(tl.join((f1 * a - b).to(dt), (f5 * a - b).to(dt)),
                     tl.join((f3 * a - b).to(dt), (f7 * a - b).to(dt)))
        w = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])
        k = step * BLOCK_K + offs_k
        if HAS_PERM:
            k = tl.load(perm_ptr + k)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    store_tile(out_ptr, acc, rm, rn, m_ok, n_ok, stride_om, ATOMIC)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           group_size: int, perm: torch.Tensor | None) -> int:
    n, kw = qweight.shape
    k = kw * 8
    if qweight.dtype != torch.int32 or qweight.stride(1) != 1:
        raise ValueError("qweight must be int32 [N, K/8] with contiguous rows")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if group_size % 8 or k % group_size:
        raise ValueError(f"group size {group_size} must be a multiple of 8 dividing K={k}")
    groups = k // group_size
    if scales.shape != (n, groups) or zeros.shape != (n, groups):
        raise ValueError(f"scales/zeros must be [{n}, {groups}], got {tuple(scales.shape)} "
                         f"and {tuple(zeros.shape)}")
    if zeros.dtype != torch.uint8 or scales.stride() != zeros.stride() or scales.stride(1) != 1:
        raise ValueError("zeros must be uint8 with the same (row-contiguous) strides as scales")
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int32):
        raise ValueError("perm must be int32 [K]")
    return k


def w4a16_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
    kernel: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    split_k: int | None = None,
    gated: bool = False,
    pdl: str = "auto",
    marlin: bool = False,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype (see the module docstring for the layout; marlin:
    qweight in kernels/w4a16_marlin.py's re-packed layout instead, served by that GEMM for
    every row count but one, and by the GEMV reading the same layout for one). kernel:
    None (CUDA: the GEMV for one row, kernels/w4a16_mma.py for 2-64, the GEMM for more;
    the interpreter: the GEMM), or "gemv" / "mma" / "gemm" to force one. gated: the weight is
    [gate; up] and the result silu(gate) * up [..., N / 2], fused into the GEMV
    (kernels/gemv_rows.py) when it runs; `pdl`: the selection's pdl mode for the GEMV."""
    k = _check(x, qweight, scales, zeros, group_size, perm)
    n = qweight.shape[0]
    check_gated(n, gated)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n // 2 if gated else n)
    if marlin:
        if use_gemv(x, m, kernel) and (m == 1 or kernel == "gemv") and gemv_ok(
                x2, qweight, scales, group_size, perm):
            out = w4a16_gemv(x2, qweight, scales, zeros, group_size, perm, block_n=block_n,
                             gated=gated, pdl=pdl, marlin=True)
            return out.reshape(*x.shape[:-1], -1)
        if not marlin_ok(k, group_size):
            raise ValueError(f"the re-packed 4-bit layout needs K={k} and the group "
                             f"{group_size} multiples of 64")
        out = w4a16_marlin(x2, qweight, scales, zeros, group_size, perm)
        out = out.reshape(*x.shape[:-1], n)
        return silu_and_mul_triton(out) if gated else out
    perm_arg = perm if perm is not None else qweight  # never read without HAS_PERM
    # 2..64 rows (batched decode) on a GPU: the nibble-plane tensor-core GEMM
    if (kernel == "mma" or (kernel is None and x.is_cuda and not INTERPRET)) and mma_ok(
            x2, k, group_size):
        out = w4a16_mma(x2, qweight, scales, zeros, group_size, perm)
        out = out.reshape(*x.shape[:-1], n)
        return silu_and_mul_triton(out) if gated else out
    if kernel == "mma":
        raise ValueError(f"the 4-bit MMA GEMM does not take {m} rows, K={k}, group {group_size}")
    # one x row: the GEMV; 2+ rows share each dequantized tile in the GEMM (tensor cores)
    if use_gemv(x, m, kernel) and (m == 1 or kernel == "gemv") and gemv_ok(
            x2, qweight, scales, group_size, perm):
        out = w4a16_gemv(x2, qweight, scales, zeros, group_size, perm, block_n=block_n,
                         gated=gated, pdl=pdl)
        return out.reshape(*x.shape[:-1], -1)
    bm, bn = _gemm_tiles(x, m, n, block_m, block_n)
    bk = min(64 if x.is_cuda else 128, group_size & -group_size)  # divides the group
    if x.is_cuda and bk < 16:
        raise ValueError(f"4-bit group size {group_size}: the GPU GEMM needs groups divisible "
                         "by 16 (tensor-core K steps of 16+)")
    split_k = split_k_for(x, triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, bk), split_k)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)](
        x2, qweight, scales, zeros, perm_arg, out, m, n, k, x2.stride(0), qweight.stride(0),
        scales.stride(0), out.stride(0), group_size, split_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        ATOMIC=split_k > 1, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_ASM=x.is_cuda and not INTERPRET, HAS_PERM=perm is not None,
        num_warps=4, num_stages=2,
    )
    out = out.to(x.dtype).reshape(*x.shape[:-1], n)
    return silu_and_mul_triton(out) if gated else out
