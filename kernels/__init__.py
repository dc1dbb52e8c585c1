"""flotilla kernels: one function per op, dispatching on the device of its inputs.

CUDA tensors run the Triton kernel (`*_triton` in each module); anything else runs the torch
reference (`*_ref`), which is what the CPU engine serves with. Every op takes the caller's
kernel selection (kernels/selection.py; the layers pass the one they were given, the default
otherwise): its `kernels="torch"` (FLOTILLA_KERNELS=torch) forces the references on CUDA too
(debugging, A/B comparisons), and the op hands the Triton kernel the other fields it needs
(pdl, prefill_tile, fp8_gemv) as explicit arguments.

Attention dispatch: decode-only batches (every sequence has q_len == 1) use the split-KV decode
kernel; mixed or prefill batches use the prefill/extend kernel (see kernels/paged_attention.py).
The KV-cache ops take optional `kv_scales`: then the caches are fp8 e4m3 with one scale per
(token, KV head), quantized on write and dequantized inside the kernels (kernels/kv_quant.py).

Quantized matmuls (gguf_matmul, w4a16_matmul, fp8_matmul) keep weights packed on the GPU and
decode them in registers (GEMV for decode, tiled GEMM for prefill); the references dequantize.

`argmax` (kernels/argmax.py) takes greedy rows' tokens (two small launches on CUDA instead of
torch's one block per row); the rest of sampling is services/engine/sampler.py.
"""

from __future__ import annotations

import torch

from flotilla.kernels.activation import SwigluOAI, silu_and_mul_ref, silu_and_mul_triton
from flotilla.kernels.argmax import argmax_ref, argmax_triton
from flotilla.kernels.attention_metadata import AttentionMetadata
from flotilla.kernels.fp8 import fp8_matmul_ref, fp8_matmul_triton
from flotilla.kernels.fused_moe import fused_moe_ref, fused_moe_triton
from flotilla.kernels.gguf_matmul import gguf_matmul_ref, gguf_matmul_triton
from flotilla.kernels.kv_cache import write_kv_cache_ref, write_kv_cache_triton
from flotilla.kernels.kv_quant import FP8_KV_DTYPE, KVScales
from flotilla.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from flotilla.kernels.rms_norm import (
    AddNormOutput,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from flotilla.kernels.rotary import RotaryOutput, rotary_embedding_ref, rotary_embedding_triton
from flotilla.kernels.rotary_kv import rotary_write_kv_cache_ref, rotary_write_kv_cache_triton
from flotilla.kernels.selection import DEFAULT_SELECTION, KernelSelection
from flotilla.kernels.triton_compat import HAVE_TRITON
from flotilla.kernels.w4a16 import w4a16_matmul_ref, w4a16_matmul_triton

__all__ = [
    "DEFAULT_SELECTION",
    "FP8_KV_DTYPE",
    "AddNormOutput",
    "KernelSelection",
    "KVScales",
    "RotaryOutput",
    "SwigluOAI",
    "argmax",
    "fused_add_rms_norm",
    "fused_moe",
    "fp8_matmul",
    "gguf_matmul",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "rotary_write_kv_cache",
    "silu_and_mul",
    "use_triton",
    "w4a16_matmul",
    "write_kv_cache",
]

def use_triton(t: torch.Tensor, kernels: str = "auto") -> bool:
    """True when `t` lives on CUDA, Triton is installed (kernels/triton_compat.py) and the
    references are not forced (`kernels`: the selection's kernels field, auto or torch;
    kernels/selection.py)."""
    return HAVE_TRITON and t.is_cuda and kernels != "torch"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             round_normed: bool = True, *,
             selection: KernelSelection = DEFAULT_SELECTION) -> torch.Tensor:
    """x [T, H] -> (x * rsqrt(mean(x^2) + eps)) * weight, statistics in fp32; the normalised
    row is rounded to x's dtype before the scale unless `round_normed` is False (gpt-oss)."""
    if use_triton(x, selection.kernels):
        return rms_norm_triton(x, weight, eps, round_normed, pdl=selection.pdl)
    return rms_norm_ref(x, weight, eps, round_normed)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    round_normed: bool = True, *, selection: KernelSelection = DEFAULT_SELECTION,
) -> AddNormOutput:
    """new_residual = x + residual; returns (rms_norm(new_residual), new_residual)."""
    if use_triton(x, selection.kernels):
        return fused_add_rms_norm_triton(x, residual, weight, eps, round_normed,
                                         pdl=selection.pdl)
    return fused_add_rms_norm_ref(x, residual, weight, eps, round_normed)


def fused_moe(
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
    *,
    selection: KernelSelection = DEFAULT_SELECTION,
) -> torch.Tensor:
    """Mixture of experts, x [T, H] -> [T, H]: sum over k of topk_weights[t, k] *
    W2[e] @ silu_and_mul(W13[e] @ x[t]) with e = topk_ids[t, k]; w13 [E, 2I, H] (gate rows, then
    up rows), w2 [E, H, I]. Ids outside [0, E) (other ranks' experts) contribute nothing.
    Optional biases b13 [E, 2I] / b2 [E, H]; `swiglu`: gpt-oss's clamped SwiGLU instead;
    `activation="gelu_tanh"`: gelu_tanh(gate) * up (Gemma 4); `weight_on_input`: the weight
    scales x[t] instead (llama4)."""
    fn = fused_moe_triton if use_triton(x, selection.kernels) else fused_moe_ref
    return fn(x, w13, w2, topk_weights, topk_ids, b13, b2, swiglu, weight_on_input, activation)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    selection: KernelSelection = DEFAULT_SELECTION,
) -> RotaryOutput:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by positions [T]; returns new (q, k)."""
    fn = rotary_embedding_triton if use_triton(q, selection.kernels) else rotary_embedding_ref
    return fn(positions, q, k, cos_sin_cache, is_neox)


def rotary_write_kv_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
    *,
    selection: KernelSelection = DEFAULT_SELECTION,
) -> torch.Tensor:
    """rotary_embedding + write_kv_cache of the rotated k and v in one pass; returns rotated q."""
    if use_triton(q, selection.kernels):
        return rotary_write_kv_cache_triton(positions, q, k, v, cos_sin_cache, is_neox, k_cache,
                                            v_cache, slot_mapping, kv_scales, pdl=selection.pdl)
    return rotary_write_kv_cache_ref(positions, q, k, v, cos_sin_cache, is_neox, k_cache,
                                     v_cache, slot_mapping, kv_scales)


def silu_and_mul(x: torch.Tensor, *,
                 selection: KernelSelection = DEFAULT_SELECTION) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    return (silu_and_mul_triton if use_triton(x, selection.kernels) else silu_and_mul_ref)(x)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
    *,
    selection: KernelSelection = DEFAULT_SELECTION,
) -> None:
    """In place: cache.view(-1, Hk, D)[slot_mapping[t]] = k[t] (v likewise); slot -1 skips.
    With kv_scales: e4m3 rows and their scales instead."""
    fn = write_kv_cache_triton if use_triton(k, selection.kernels) else write_kv_cache_ref
    fn(k, v, k_cache, v_cache, slot_mapping, kv_scales)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    kv_scales: KVScales | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    *,
    selection: KernelSelection = DEFAULT_SELECTION,
) -> torch.Tensor:
    """Causal GQA attention of the new tokens q [T, Hq, D] over the paged cache -> [T, Hq, D];
    sinks [Hq]: a learned logit per head in each softmax's denominator (gpt-oss);
    attention_chunk C: a token sees only keys of its own C-aligned chunk (llama4)."""
    if use_triton(q, selection.kernels):
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window,
                                      logit_softcap, kv_scales=kv_scales, sinks=sinks,
                                      attention_chunk=attention_chunk, pdl=selection.pdl,
                                      tile=selection.prefill_tile)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, logit_softcap,
                               kv_scales=kv_scales, sinks=sinks, attention_chunk=attention_chunk)


def argmax(logits: torch.Tensor, *,
           selection: KernelSelection = DEFAULT_SELECTION) -> torch.Tensor:
    """int64 [B]: each row's argmax of logits [B, V], the lowest index on ties (torch.argmax)."""
    return (argmax_triton if use_triton(logits, selection.kernels) else argmax_ref)(logits)


def gguf_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: int, *,
                selection: KernelSelection = DEFAULT_SELECTION) -> torch.Tensor:
    """x [..., K] @ W.T with W = GGUF blocks uint8 [N, row_bytes] of ggml type `qtype`."""
    if use_triton(x, selection.kernels):
        return gguf_matmul_triton(x, qweight, qtype, pdl=selection.pdl)
    return gguf_matmul_ref(x, qweight, qtype)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None = None, *,
                 selection: KernelSelection = DEFAULT_SELECTION) -> torch.Tensor:
    """x [..., K] @ W.T with W int4 (kernels/w4a16.py layout; perm: GPTQ act-order)."""
    if use_triton(x, selection.kernels):
        return w4a16_matmul_triton(x, qweight, scales, zeros, group_size, perm,
                                   pdl=selection.pdl)
    return w4a16_matmul_ref(x, qweight, scales, zeros, group_size, perm)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
               selection: KernelSelection = DEFAULT_SELECTION) -> torch.Tensor:
    """x [..., K] @ (W8 * scale).T with W8 e4m3 [N, K] and float32 scales [N, G]."""
    if use_triton(x, selection.kernels):
        return fp8_matmul_triton(x, weight, scale, fp8_gemv=selection.fp8_gemv,
                                 pdl=selection.pdl)
    return fp8_matmul_ref(x, weight, scale)
