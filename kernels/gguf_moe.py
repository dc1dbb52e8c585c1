"""Fused mixture-of-experts over GGUF-quantized expert stacks, dequantized on the fly.

Expert weights stay in the file's ggml blocks (kernels/gguf_dequant.py): a stack is uint8
[E, N, K / QK * TYPE_SIZE], one [N, row_bytes] block matrix per expert. A projection may be
made of several such stacks of different types, each owning a run of output columns
(`QuantPart`): llama.cpp's mixed recipes keep gate and up in one type and may put down in
another, and nothing forbids gate and up differing.

`fused_moe_gguf_triton` is kernels/fused_moe.py's scheme (pairs sorted into BLOCK_M tiles of one
expert by `moe_align_block_size`, a grouped GEMM for gate_up, silu_and_mul, a grouped GEMM for
down that scales each row by its top-k weight, a sum over the K rows of each token) with the B
tile decoded in registers exactly as kernels/gguf_matmul.py's GEMM does: per loop step, NSB
consecutive blocks of BLOCK_N rows of the tile's expert are decoded one 32-weight group at a time
(`dequant_group`) into a [BLOCK_N, NSB * 32] tile in x's dtype and multiplied with the matching
x columns on the tensor cores. Pairs whose expert id is -1 (another rank's) add nothing.
`fused_moe_gguf_ref` dequantizes the stacks (torch) and runs fused_moe_ref.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from flotilla.kernels.activation import silu_and_mul_triton
from flotilla.kernels.fused_moe import fused_moe_ref, moe_align_block_size
from flotilla.kernels.gguf_dequant import Q2_K, Q3_K, Q6_K, dequantize_ref, gguf_type
from flotilla.kernels.gguf_iq import iq_grid
from flotilla.kernels.gguf_matmul import dequant_dot_blocks
from flotilla.kernels.triton_compat import tl, triton


class QuantPart(NamedTuple):
    """Output columns of one ggml type: blocks uint8 [E, rows, row_bytes], contiguous."""

    blocks: torch.Tensor
    qtype: int


def dequantize_parts(parts: Sequence[QuantPart], dtype: torch.dtype) -> torch.Tensor:
    """Parts -> float [E, sum of rows, K] in `dtype` (the torch path and the reference)."""
    stacks = []
    for blocks, qtype in parts:
        e, n = blocks.shape[:2]
        dense = dequantize_ref(blocks.reshape(e * n, blocks.shape[2]), qtype)
        stacks.append(dense.reshape(e, n, -1).to(dtype))
    return torch.cat(stacks, dim=1)


def fused_moe_gguf_ref(x: torch.Tensor, w13: Sequence[QuantPart], w2: Sequence[QuantPart],
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    return fused_moe_ref(x, dequantize_parts(w13, x.dtype), dequantize_parts(w2, x.dtype),
                         topk_weights, topk_ids)


@triton.jit
def _gguf_moe_kernel(
    a_ptr,  # [rows, K] input rows, unit stride along K; pair p reads row p // A_ROW_DIV
    w_ptr,  # uint8 [E, N, row_bytes] blocks
    w16_ptr,  # the same bytes viewed as f16
    grid_ptr,  # float32 IQ grid (kernels/gguf_iq.py iq_grid)
    c_ptr,  # [num_pairs, >= N] output columns of this part, one row per (token, expert) pair
    weights_ptr,  # float32 [num_pairs] top-k weight of each pair (read when MUL_WEIGHT)
    sorted_ids_ptr,  # int32 [capacity] pair of each tile row; >= num_pairs marks padding
    expert_ids_ptr,  # int32 [capacity / BLOCK_M] expert of each tile; -1 = unused tile
    num_pairs,
    n_out,
    k_in,
    stride_am,
    stride_we,  # bytes between experts
    stride_wn,  # bytes between rows
    stride_cm,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,  # weights per block
    TYPE_SIZE: tl.constexpr,  # bytes per block
    A_ROW_DIV: tl.constexpr,  # top_k when a is x (pairs share their token's row), else 1
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NSB: tl.constexpr,  # blocks per loop step: one dot covers NSB * 32 weights per group
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    a_rows = a_ptr + (pair // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < n_out
    row_off = expert * stride_we + rn.to(tl.int64) * stride_wn
    nblocks = k_in // QK
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = dequant_dot_blocks(acc, w_ptr, w16_ptr, grid_ptr, row_off, n_ok, a_rows, row_ok, 0,
                             nblocks, QTYPE, QK, TYPE_SIZE, BLOCK_N, NSB, DOT_PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _tiles(a: torch.Tensor, qtype: int, n: int, nblocks: int, block_n: int | None
           ) -> tuple[int, int, int]:
    """(BLOCK_N, NSB, warps): kernels/gguf_matmul.py's GEMM choices on a GPU; under the
    interpreter (cost per operation) wide tiles, bounded by Triton's 2**20 elements."""
    t = gguf_type(qtype)
    if a.is_cuda:
        if int(qtype) in (Q2_K, Q3_K, Q6_K):
            return block_n or 64, 1, 8
        return block_n or 64, 2 if t.qk == 256 else 4, 4
    bn = block_n or min(triton.next_power_of_2(n), 256)
    return bn, min(triton.next_power_of_2(nblocks), 4 if t.qk == 256 else 16), 4


def _grouped_gemm(a: torch.Tensor, parts: Sequence[QuantPart], c: torch.Tensor,
                  weights: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                  a_row_div: int, mul_weight: bool, block_m: int, block_n: int | None) -> None:
    col = 0
    for blocks, qtype in parts:
        t = gguf_type(qtype)
        n, k = blocks.shape[1], blocks.shape[2] // t.type_size * t.qk
        if k != a.shape[1]:
            raise ValueError(f"{t.name} expert blocks hold {k} inputs, the activations "
                             f"{a.shape[1]}")
        bn, nsb, warps = _tiles(a, qtype, n, k // t.qk, block_n)
        out = c[:, col:col + n]
        w16 = blocks.view(torch.float16)
        _gguf_moe_kernel[(expert_ids.shape[0], triton.cdiv(n, bn))](
            a, blocks, w16, iq_grid(qtype, a.device, w16), out, weights,
            sorted_ids, expert_ids,
            c.shape[0], n, k, a.stride(0), blocks.stride(0), blocks.stride(1), out.stride(0),
            QTYPE=int(qtype), QK=t.qk, TYPE_SIZE=t.type_size, A_ROW_DIV=a_row_div,
            MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=bn, NSB=nsb,
            DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            num_warps=warps, num_stages=2,
        )
        col += n
    if col != c.shape[1]:
        raise ValueError(f"expert parts give {col} output columns, expected {c.shape[1]}")


def _check(x: torch.Tensor, w13: Sequence[QuantPart], w2: Sequence[QuantPart],
           topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[int, int]:
    """(experts, intermediate size)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H] with a contiguous last dim, got {tuple(x.shape)}")
    if not w13 or not w2:
        raise ValueError("w13 and w2 need at least one part each")
    num_experts = w13[0].blocks.shape[0]
    for blocks, qtype in (*w13, *w2):
        gguf_type(qtype)
        if blocks.dtype != torch.uint8 or blocks.dim() != 3 or not blocks.is_contiguous() \
                or blocks.shape[0] != num_experts:
            raise ValueError(f"expert blocks must be contiguous uint8 [{num_experts}, N, "
                             f"row_bytes], got {blocks.dtype} {tuple(blocks.shape)}")
    two_inter = sum(p.blocks.shape[1] for p in w13)
    if two_inter % 2 or sum(p.blocks.shape[1] for p in w2) != x.shape[1]:
        raise ValueError(f"w13 rows {two_inter} / w2 rows do not fit hidden size {x.shape[1]}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or \
            topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{x.shape[0]}, top_k]")
    return num_experts, two_inter // 2


def fused_moe_gguf_triton(
    x: torch.Tensor, w13: Sequence[QuantPart], w2: Sequence[QuantPart],
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """x [T, H] (16-bit or fp32) -> [T, H]; w13's parts together are [E, 2I, H] (gate rows,
    then up rows), w2's [E, H, I]."""
    num_experts, inter = _check(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if block_m is None:  # small tiles when few pairs per expert (decode), larger for prefill
        block_m = 16 if num_pairs <= 4 * num_experts else 64
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    gate_up = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, sorted_ids, expert_ids, top_k, False, block_m,
                  block_n)
    hidden = silu_and_mul_triton(gate_up)  # rows of dropped pairs are garbage, never read
    # Zero-filled: pairs routed to other ranks' experts are never written and must add nothing.
    down = torch.zeros(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(hidden, w2, down, weights, sorted_ids, expert_ids, 1, True, block_m, block_n)
    return down.view(num_tokens, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)
