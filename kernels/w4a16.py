"""4-bit weight x 16-bit activation matmul (GPTQ / AWQ checkpoints after loading).

Layout (both formats are repacked into it at load time, services/engine/quant/w4a16.py):
- qweight int32 [N, K // 8]: word w of row n holds weights k = 8w .. 8w+7, weight 8w+i in bits
  4i .. 4i+3 (the GPTQ order along K, transposed so each output row is contiguous);
- scales fp16 [N, K // G] and zeros uint8 [N, K // G]: w[n, k] = (q - zero) * scale of group k // G;
- perm int32 [K] or None (GPTQ act-order): the checkpoint's K order was sorted by group at load
  time, so kernel position k multiplies x[perm[k]].

GEMV (decode-sized M on a GPU, kernels/gguf_matmul.py: use_gemv): [BLOCK_N, NCHUNK, CHUNK] tiles
of unpacked codes; each chunk lies in one group, so codes are dotted with x first and scale/zero
applied per (row, chunk); codes become floats through their mantissa bits (u4_to_f32), and the
tile (BLOCK_N rows, STEP weights per step, warps) is autotuned per (N, K, G) on CUDA.
GEMM: each [BLOCK_N, BLOCK_K] weight tile is unpacked and scaled in registers, cast to x's dtype
and fed to tl.dot; split_k as in kernels/gguf_matmul.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.gguf_dequant import u4_to_f32
from kernels.gguf_matmul import _gemm_tiles, split_k_for, use_gemv
from kernels.tuning import warmup_autotune


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
def _nibbles(q, i: tl.constexpr):
    return u4_to_f32((q >> (4 * i)) & 15)


@triton.jit
def _unpack(q):
    """int32 words [..., W] -> float32 codes [..., W, 2, 2, 2]; flattening the last four axes
    gives nibble order 8w + i. tl.join keeps its new axis inside each thread, so the unpacking
    moves no data between threads."""
    lo = tl.join(tl.join(_nibbles(q, 0), _nibbles(q, 4)), tl.join(_nibbles(q, 2), _nibbles(q, 6)))
    hi = tl.join(tl.join(_nibbles(q, 1), _nibbles(q, 5)), tl.join(_nibbles(q, 3), _nibbles(q, 7)))
    return tl.join(lo, hi)


@triton.jit
def _gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, out_ptr,
    N, K,
    stride_xm, stride_q, stride_s, stride_om,
    group_size,
    HAS_PERM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,  # weights per chunk; a power of two dividing the group size
    STEP: tl.constexpr,  # weights per row and loop step (a multiple of CHUNK)
):
    """Per (row, chunk): dot = sum(q * x), then acc += scale * (dot - zero * sum(x)); scales
    and zeros are [BLOCK_N, NCHUNK] tiles, never expanded to the weights."""
    NCHUNK: tl.constexpr = STEP // CHUNK
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    CW: tl.constexpr = CHUNK // 8
    nchunks = K // CHUNK
    offs_c = tl.arange(0, NCHUNK)
    offs_w = tl.arange(0, CW)
    offs_k = tl.arange(0, CHUNK)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N, NCHUNK], dtype=tl.float32)
    for c0 in range(0, nchunks, NCHUNK):
        c = c0 + offs_c
        c_ok = c < nchunks
        words = c[:, None] * CW + offs_w[None, :]
        q = tl.load(q_ptr + rows[:, None, None] * stride_q + words[None, :, :],
                    mask=row_ok[:, None, None] & c_ok[None, :, None], other=0)
        codes = tl.reshape(_unpack(q), [BLOCK_N, NCHUNK, CHUNK])
        k = c[:, None] * CHUNK + offs_k[None, :]
        if HAS_PERM:
            k = tl.load(perm_ptr + k, mask=c_ok[:, None], other=0)
        x = tl.load(x_row + k, mask=c_ok[:, None], other=0.0).to(tl.float32)
        dot = tl.sum(codes * x[None, :, :], axis=2)
        grp = rows[:, None] * stride_s + ((c * CHUNK) // group_size)[None, :]
        ok = row_ok[:, None] & c_ok[None, :]
        s = tl.load(s_ptr + grp, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + grp, mask=ok, other=0).to(tl.float32)
        acc += s * (dot - z * tl.sum(x, axis=1)[None, :])
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + m * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


# GEMV tiles tried on the device (keyed on N, K, group): 2-16 rows per program, 512-2048 weights
# (256 B - 1 KiB of codes) per row and step
GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "STEP": step}, num_warps=w)
    for bn, step, w in ((8, 1024, 4), (4, 1024, 4), (16, 1024, 8), (8, 2048, 8), (4, 2048, 4),
                        (16, 512, 4), (2, 2048, 4), (8, 512, 2))
]
# act-order (HAS_PERM) gathers x through the permutation: 8 rows x 1024 with 4 warps spills
# 4 bytes on sm_90 there (tests/quant/sm90_compile.py), the other tiles do not
GEMV_CONFIGS_PERM = [c for c in GEMV_CONFIGS
                     if (c.kwargs["BLOCK_N"], c.kwargs["STEP"], c.num_warps) != (8, 1024, 4)]
_gemv_tuned = warmup_autotune(GEMV_CONFIGS, ["N", "K", "group_size"])(_gemv_kernel)
_gemv_tuned_perm = warmup_autotune(GEMV_CONFIGS_PERM, ["N", "K", "group_size"])(_gemv_kernel)


@triton.jit
def _gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_q, stride_s, stride_om,
    group_size,
    split_k,  # programs sharing one output tile, each a run of K
    HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
        mask = n_ok[:, None] & (words < K // 8)[None, :]
        q = tl.load(q_ptr + rn[:, None] * stride_q + words[None, :], mask=mask, other=0)
        codes = tl.reshape(_unpack(q), [BLOCK_N, BLOCK_K])
        k = step * BLOCK_K + offs_k
        k_ok = k < K
        grp = rn[:, None] * stride_s + (k // group_size)[None, :]
        s = tl.load(s_ptr + grp, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + grp, mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.float32)
        w = ((codes - z) * s).to(x_ptr.dtype.element_ty)
        if HAS_PERM:
            k = tl.load(perm_ptr + k, mask=k_ok, other=0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype (see the module docstring for the layout)."""
    k = _check(x, qweight, scales, zeros, group_size, perm)
    n = qweight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    perm_arg = perm if perm is not None else qweight  # never read without HAS_PERM
    common = dict(HAS_PERM=perm is not None)
    if use_gemv(x, m, kernel):
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        chunk = min(128, group_size & -group_size)  # largest power of two dividing G, <= 128
        args = (x2, qweight, scales, zeros, perm_arg, out, n, k, x2.stride(0),
                qweight.stride(0), scales.stride(0), out.stride(0), group_size)
        if x.is_cuda and block_n is None:  # autotuned (before any CUDA-graph capture)
            tuned = _gemv_tuned if perm is None else _gemv_tuned_perm
            tuned[lambda a: (triton.cdiv(n, a["BLOCK_N"]), m)](*args, CHUNK=chunk, **common)
        else:
            bn = block_n or (8 if perm is None else 4)
            _gemv_kernel[(triton.cdiv(n, bn), m)](*args, BLOCK_N=bn, CHUNK=chunk,
                                                  STEP=max(chunk, 1024), num_warps=4, **common)
        return out.reshape(*x.shape[:-1], n)
    bm, bn = _gemm_tiles(x, m, n, block_m, block_n)
    bk = 64 if x.is_cuda else min(triton.next_power_of_2(k), 1024)
    split_k = split_k_for(x, triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, bk), split_k)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)](
        x2, qweight, scales, zeros, perm_arg, out, m, n, k, x2.stride(0), qweight.stride(0),
        scales.stride(0), out.stride(0), group_size, split_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        ATOMIC=split_k > 1, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2, **common,
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
