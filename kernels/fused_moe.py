"""Fused mixture-of-experts MLP: each token runs through its top-k experts' gated MLPs.

    out[t] = sum_k topk_weights[t, k] * W2[e] @ silu_and_mul(W13[e] @ x[t]),  e = topk_ids[t, k]

W13 [E, 2I, H] stacks each expert's gate rows then up rows, W2 [E, H, I] its down projection
(nn.Linear layout: out x in). Pairs whose expert id is outside [0, E) contribute nothing: that is
how a rank skips the experts other tensor-parallel ranks own. Optional per-expert biases b13
[E, 2I] / b2 [E, H] are added to the projections (b2 before the top-k weight), and `swiglu`
(kernels/activation.py SwigluOAI, gpt-oss) replaces silu_and_mul; `activation="gelu_tanh"`
(Gemma 4's experts) takes gelu_tanh(gate) * up instead, as torch ops rounded as transformers
rounds them (no kernel of its own: elementwise between the two grouped GEMMs). With
`weight_on_input` (llama4) the top-k weight scales the token's input to the expert instead of
its output.

Triton path (the vLLM / SGLang scheme):
1. `moe_align_block_size` sorts the T*K (token, expert) pairs by expert and pads each expert's
   run to a multiple of BLOCK_M, so that every BLOCK_M-row tile belongs to a single expert. It is
   vectorised torch with shapes known from the inputs alone (no host sync, CUDA-graph safe).
2. `_fused_moe_kernel`, a grouped GEMM over those tiles: a tile gathers its input rows, multiplies
   them with its expert's weight and scatters the rows back to their pairs. It runs twice: gate_up
   on x (row t of x for pair t*K + k), then, after silu_and_mul, down on the per-pair rows, that
   second pass scaling each row by its top-k weight.
3. The K weighted rows of each token are summed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.activation import (
    SwigluOAI,
    silu_and_mul_triton,
    swiglu_oai_ref,
    swiglu_oai_triton,
)
from flotilla.kernels.triton_compat import tl, triton


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: SwigluOAI | None = None,
    weight_on_input: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    """Loop over the experts that received tokens: gather, gated MLP, weight, scatter-add."""
    _check_activation(activation, swiglu)
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1)
    valid = (flat_ids >= 0) & (flat_ids < num_experts)
    for expert in torch.unique(flat_ids[valid]).tolist():
        pairs = torch.nonzero(flat_ids == expert).squeeze(1)
        tokens = pairs // top_k
        rows = x.index_select(0, tokens)
        if weight_on_input:
            rows = rows * flat_weights[pairs, None].to(rows.dtype)
        gate_up = F.linear(rows, w13[expert], None if b13 is None else b13[expert])
        if swiglu is not None:
            hidden = swiglu_oai_ref(gate_up, swiglu)
        elif activation == "gelu_tanh":
            hidden = gelu_tanh_and_mul(gate_up)
        else:
            hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(hidden, w2[expert], None if b2 is None else b2[expert]).float()
        if not weight_on_input:
            y = y * flat_weights[pairs, None].float()
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


ACTIVATIONS = ("silu", "gelu_tanh")


def _check_activation(activation: str, swiglu: SwigluOAI | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported expert activation {activation!r}; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    if swiglu is not None and activation != "silu":
        raise ValueError("the clamped SwiGLU replaces the activation; pass one or the other")


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate, up halves) -> gelu_tanh(gate) * up, each op rounded to the input dtype
    (transformers' `act_fn(gate) * up`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, expert) pairs by expert into BLOCK_M tiles.

    Returns sorted_ids int32 [capacity]: the flat pair index (t * K + k) of each tile row, or
    T * K for padding rows; and expert_ids int32 [capacity // block_m]: each tile's expert, -1
    for the unused tiles at the end. capacity = T*K + min(T*K, E) * (block_m - 1), rounded up to
    block_m, bounds the padded length whatever the routing.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    capacity = triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1),
                           block_m) * block_m
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # invalid pairs sort last and are dropped
    # scatter_add, not bincount: bincount reads its max on the host (a sync, no CUDA graphs).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    tile_ends = torch.cumsum(padded, 0)
    tile_starts = tile_ends - padded
    first_sorted = torch.cumsum(counts, 0) - counts  # index of each expert's first sorted pair
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    expert = sorted_key.clamp(max=num_experts - 1)
    dest = tile_starts[expert] + torch.arange(num_pairs, device=device) - first_sorted[expert]
    dest = torch.where(sorted_key < num_experts, dest, capacity)  # row `capacity` is a dump
    sorted_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    tile_first_row = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(tile_ends, tile_first_row, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids[:capacity], expert_ids


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [rows, K_IN] input rows, last dim contiguous; pair p reads row p // A_ROW_DIV
    b_ptr,  # [E, N, K_IN] expert weights, last dim contiguous
    c_ptr,  # [num_pairs, N] output, one row per (token, expert) pair, last dim contiguous
    bias_ptr,  # [E, N] per-expert bias, contiguous (read when HAS_BIAS)
    weights_ptr,  # float32 [num_pairs] top-k weight of each pair (read when MUL_WEIGHT)
    sorted_ids_ptr,  # int32 [capacity] pair of each tile row; >= num_pairs marks padding
    expert_ids_ptr,  # int32 [capacity / BLOCK_M] expert of each tile; -1 = unused tile
    num_pairs,  # T * K
    n_out,  # N
    k_in,  # K_IN
    stride_am,  # row stride of a
    stride_be,  # expert stride of b
    stride_bn,  # row stride of b
    stride_cm,  # row stride of c
    A_ROW_DIV: tl.constexpr,  # top_k when a is x (pairs share their token's row), else 1
    MUL_WEIGHT: tl.constexpr,  # scale each output row by its pair's top-k weight
    HAS_BIAS: tl.constexpr,  # add the expert's bias row (before the top-k weight)
    BLOCK_M: tl.constexpr,  # rows per tile (the alignment of moe_align_block_size)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), else "tf32" (ignored)
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
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_mask = offs_k < k_in - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * n_out + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=row_mask, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, a_row_div: int, mul_weight: bool,
    block_m: int, block_n: int, block_k: int, bias: torch.Tensor | None = None,
) -> None:
    n_out, k_in = b.shape[1], b.shape[2]
    grid = (expert_ids.shape[0], triton.cdiv(n_out, block_n))
    _fused_moe_kernel[grid](
        a, b, c, b if bias is None else bias, weights, sorted_ids, expert_ids,
        c.shape[0], n_out, k_in,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=mul_weight, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, b13: torch.Tensor | None = None,
           b2: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    (num_tokens, hidden), (num_experts, two_inter, _) = x.shape, w13.shape
    if w13.shape[2] != hidden or two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden size "
                         f"{hidden}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or \
            topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{num_tokens}, top_k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights {w13.dtype}/{w2.dtype} must match x {x.dtype}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    if w13.stride(0) != w13.shape[1] * w13.stride(1) or w2.stride(0) != w2.shape[1] * w2.stride(1):
        raise ValueError("w13 / w2 must be stacked [E, N, K] with rows contiguous per expert")
    for name, bias, w in (("b13", b13, w13), ("b2", b2, w2)):
        if bias is not None and (bias.shape != w.shape[:2] or not bias.is_contiguous()):
            raise ValueError(f"{name} must be contiguous {tuple(w.shape[:2])}, got "
                             f"{tuple(bias.shape)}")


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu: SwigluOAI | None = None,
    weight_on_input: bool = False,
    activation: str = "silu",
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    _check(x, w13, w2, topk_weights, topk_ids, b13, b2)
    _check_activation(activation, swiglu)
    if weight_on_input and b13 is not None:
        raise ValueError("weight_on_input with a gate_up bias is not a linear scaling")
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if block_m is None:  # small tiles when few pairs per expert (decode), larger for prefill
        block_m = 16 if num_pairs <= 4 * num_experts else 64
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    gate_up = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    # the input's weight scales the (bias-free) gate_up rows: the same as scaling the input
    _grouped_gemm(x, w13, gate_up, weights, sorted_ids, expert_ids, top_k, weight_on_input,
                  block_m, block_n, block_k, b13)
    # rows of dropped pairs are garbage, never read
    if swiglu is not None:
        hidden = swiglu_oai_triton(gate_up, swiglu)
    elif activation == "gelu_tanh":
        hidden = gelu_tanh_and_mul(gate_up)
    else:
        hidden = silu_and_mul_triton(gate_up)
    # Zero-filled: pairs routed to other ranks' experts are never written and must add nothing.
    down = torch.zeros(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(hidden, w2, down, weights, sorted_ids, expert_ids, 1, not weight_on_input,
                  block_m, block_n, block_k, b2)
    return down.view(num_tokens, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)
