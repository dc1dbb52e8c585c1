"""Fused mixture-of-experts over MXFP4 expert weights (gpt-oss), dequantized on the fly.

MXFP4 (OCP microscaling): each run of 32 consecutive values along K shares one E8M0 scale (a
uint8 exponent e, scale 2^(e - 127)); each value is an FP4 e2m1 nibble (sign, 2-bit exponent,
1-bit mantissa: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two per byte, the lower nibble first. A weight
W [N, K] (nn.Linear layout) is stored as blocks uint8 [N, K / 2] and scales uint8 [N, K / 32];
gpt-oss checkpoints hold them as `*_blocks` [E, N, K / 32, 16] and `*_scales` [E, N, K / 32].

`fused_moe_mxfp4_triton` is kernels/fused_moe.py's scheme (tiles of one expert from
`moe_align_block_size`, a grouped GEMM for gate_up, the activation, a grouped GEMM for down with
the top-k weight) with B tiles read as packed bytes plus scales and decoded in registers: the
byte tile [BLOCK_K / 2, BLOCK_N] gives the even-K values (low nibbles) and the odd-K values (high
nibbles), each multiplied by its row's scale; the A tile is read as its even and odd columns, so
the two dots need no interleave. Weights stay 4.25 bits a value in memory; the reference
dequantizes them and runs fused_moe_ref.
"""

from __future__ import annotations

import torch

from flotilla.kernels.activation import SwigluOAI, silu_and_mul_triton, swiglu_oai_triton
from flotilla.kernels.fused_moe import fused_moe_ref, moe_align_block_size
from flotilla.kernels.triton_compat import tl, triton

MXFP4_BLOCK = 32  # values per scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


def dequantize_mxfp4_ref(blocks: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., K / 2], scales uint8 [..., K / 32] -> [..., K] in `dtype`."""
    if blocks.shape[-1] != scales.shape[-1] * MXFP4_BLOCK // 2:
        raise ValueError(f"blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    values = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # low nibble first
    exponents = scales.to(torch.int32) - E8M0_BIAS
    values = values.unflatten(-1, (-1, MXFP4_BLOCK))
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)


def quantize_mxfp4_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks uint8 [..., K / 2], scales uint8 [..., K / 32]):
    each group's scale is the smallest power of two that brings its largest magnitude within 6,
    each value the nearest FP4 one (ties to the lower index). For test checkpoints."""
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"last dim {w.shape[-1]} is not a multiple of {MXFP4_BLOCK}")
    groups = w.float().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)
    scaled = torch.ldexp(groups, -exponent[..., None])
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=w.device)
    codes = (scaled[..., None] - lut).abs().argmin(-1).flatten(-2)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + E8M0_BIAS).to(torch.uint8)


def fused_moe_mxfp4_ref(
    x: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor, w2_scales: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    swiglu: SwigluOAI | None = None,
) -> torch.Tensor:
    w13 = dequantize_mxfp4_ref(w13_blocks, w13_scales, x.dtype)
    w2 = dequantize_mxfp4_ref(w2_blocks, w2_scales, x.dtype)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, b13, b2, swiglu)


@triton.jit
def _fp4_value(nibble):
    """FP4 e2m1 code (int32 in [0, 16)) -> its float value."""
    exponent = (nibble >> 1) & 3
    mantissa = (nibble & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5,
                         tl.exp2((exponent - 1).to(tl.float32)) * (1.0 + mantissa * 0.5))
    return tl.where((nibble >> 3) != 0, -magnitude, magnitude)


@triton.jit
def _fused_moe_mxfp4_kernel(
    a_ptr,  # [rows, K] input rows, last dim contiguous; pair p reads row p // A_ROW_DIV
    b_ptr,  # uint8 [E, N, K / 2] packed FP4 expert weights, last dim contiguous
    s_ptr,  # uint8 [E, N, K / 32] E8M0 scales, last dim contiguous
    c_ptr,  # [num_pairs, N] output, one row per (token, expert) pair
    bias_ptr,  # [E, N] per-expert bias, contiguous (read when HAS_BIAS)
    weights_ptr,  # float32 [num_pairs] top-k weight of each pair (read when MUL_WEIGHT)
    sorted_ids_ptr,  # int32 [capacity] pair of each tile row; >= num_pairs marks padding
    expert_ids_ptr,  # int32 [capacity / BLOCK_M] expert of each tile; -1 = unused tile
    num_pairs, n_out, k_in,  # T * K, N, K
    stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_cm,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile (the alignment of moe_align_block_size)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # K values per step, a multiple of 32 (whole scale groups)
    DOT_PRECISION: tl.constexpr,
):
    # Grid (tiles, cdiv(N, BLOCK_N)): one BLOCK_M x BLOCK_N output block of one expert's tile.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    a_rows = (pair // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_kb = tl.arange(0, BLOCK_K // 2)  # byte columns of the step
    a_base = a_ptr + a_rows[:, None] * stride_am
    b_base = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    s_base = s_ptr + expert * stride_se + offs_n[None, :].to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        kb = k0 // 2 + offs_kb
        kb_mask = kb < k_in // 2
        a_mask = row_mask[:, None] & kb_mask[None, :]
        a_even = tl.load(a_base + 2 * kb[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_base + 2 * kb[None, :] + 1, mask=a_mask, other=0.0)
        b_mask = kb_mask[:, None] & n_mask[None, :]
        packed = tl.load(b_base + kb[:, None], mask=b_mask, other=0).to(tl.int32)
        exponent = tl.load(s_base + (kb // 16)[:, None], mask=b_mask, other=127)
        scale = tl.exp2(exponent.to(tl.float32) - 127.0)
        lo = (_fp4_value(packed & 0x0F) * scale).to(a_even.dtype)
        hi = (_fp4_value(packed >> 4) * scale).to(a_even.dtype)
        acc = tl.dot(a_even, lo, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(a_odd, hi, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * n_out + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=row_mask, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _grouped_gemm_mxfp4(
    a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, c: torch.Tensor,
    bias: torch.Tensor | None, weights: torch.Tensor, sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor, a_row_div: int, mul_weight: bool, block_m: int, block_n: int,
    block_k: int,
) -> None:
    n_out, k_in = blocks.shape[1], blocks.shape[2] * 2
    grid = (expert_ids.shape[0], triton.cdiv(n_out, block_n))
    _fused_moe_mxfp4_kernel[grid](
        a, blocks, scales, c, blocks if bias is None else bias, weights, sorted_ids, expert_ids,
        c.shape[0], n_out, k_in,
        a.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1),
        c.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=mul_weight, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def _check(x: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor,
           w2_blocks: torch.Tensor, w2_scales: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H] with a contiguous last dim, got {tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden % MXFP4_BLOCK:
        raise ValueError(f"hidden size {hidden} is not a multiple of {MXFP4_BLOCK}")
    num_experts, two_inter = w13_blocks.shape[:2]
    inter = two_inter // 2
    want = {"w13_blocks": (w13_blocks, (num_experts, two_inter, hidden // 2)),
            "w13_scales": (w13_scales, (num_experts, two_inter, hidden // MXFP4_BLOCK)),
            "w2_blocks": (w2_blocks, (num_experts, hidden, inter // 2)),
            "w2_scales": (w2_scales, (num_experts, hidden, inter // MXFP4_BLOCK))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or t.dtype != torch.uint8 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous uint8 {shape}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if two_inter % 2 or inter % MXFP4_BLOCK:
        raise ValueError(f"intermediate size {inter} is not a multiple of {MXFP4_BLOCK}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or \
            topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{x.shape[0]}, top_k]")


def fused_moe_mxfp4_triton(
    x: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor, w2_scales: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    swiglu: SwigluOAI | None = None, block_m: int | None = None, block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """x [T, H] (16-bit or fp32) -> [T, H]; see the module docstring for the weight layout."""
    _check(x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids)
    if block_k % MXFP4_BLOCK:
        raise ValueError(f"block_k {block_k} must be a multiple of {MXFP4_BLOCK}")
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter = w13_blocks.shape[:2]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if block_m is None:  # small tiles when few pairs per expert (decode), larger for prefill
        block_m = 16 if num_pairs <= 4 * num_experts else 64
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    gate_up = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm_mxfp4(x, w13_blocks, w13_scales, gate_up, b13, weights, sorted_ids,
                        expert_ids, top_k, False, block_m, block_n, block_k)
    # rows of dropped pairs are garbage, never read
    hidden = silu_and_mul_triton(gate_up) if swiglu is None else swiglu_oai_triton(gate_up, swiglu)
    # Zero-filled: pairs routed to other ranks' experts are never written and must add nothing.
    down = torch.zeros(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm_mxfp4(hidden, w2_blocks, w2_scales, down, b2, weights, sorted_ids, expert_ids,
                        1, True, block_m, block_n, block_k)
    return down.view(num_tokens, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)
