"""Gated DeltaNet ops (Qwen3-Next / Qwen3.5 linear-attention layers): the public API.

Each op checks its arguments, then runs the Triton kernel on CUDA tensors and the torch
implementation otherwise (or everywhere when the caller's `kernels` is "torch": the kernel
selection's field, FLOTILLA_KERNELS=torch, kernels/selection.py):
- chunk_gated_delta_rule: prefill over packed variable-length sequences (kernels/
  gated_delta_chunk.py on CUDA);
- fused_recurrent_gated_delta_rule_update: one decode token per sequence, the state pool updated
  in place (kernels/gated_delta_recurrent.py);
- causal_conv1d_varlen / causal_conv1d_update: the depthwise conv + SiLU in front of them, with
  its own state pool (kernels/causal_conv1d.py).
The math and its equivalence to transformers' torch functions: kernels/gated_delta_torch.py.

State pools are indexed by a per-sequence slot: the recurrent state [S, Hv, Dk, Dv] fp32 and the
conv state [S, C, W-1]. Slots < 0 are padding (CUDA-graph batches): nothing is read or written
for them and their outputs are zeros. Two sequences of one call must not share a slot.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flotilla.kernels import causal_conv1d as conv
from flotilla.kernels import gated_delta_torch as ref
from flotilla.kernels.triton_compat import HAVE_TRITON


class GatedDeltaOutput(NamedTuple):
    output: torch.Tensor  # [T, Hv, Dv] in v's dtype
    final_state: torch.Tensor  # [N, Hv, Dk, Dv] fp32


def _use_triton(t: torch.Tensor, kernels: str) -> bool:
    return HAVE_TRITON and t.is_cuda and kernels != "torch"


def _check_devices(x: torch.Tensor, *others: torch.Tensor | None) -> None:
    """Index and state tensors must live with the data: a kernel cannot read host memory."""
    for t in others:
        if t is not None and t.device != x.device:
            raise ValueError(f"every tensor must be on {x.device}, got one on {t.device}")


def _check_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(
            f"q and k must be [T, Hk, Dk] alike, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if v.dim() != 3 or v.shape[0] != q.shape[0] or v.shape[1] % q.shape[1]:
        raise ValueError(
            f"v must be [T, Hv, Dv] with Hv a multiple of Hk={q.shape[1]}, got {tuple(v.shape)}"
        )
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(
            f"g and beta must be [T, Hv] = {tuple(v.shape[:2])}, got "
            f"{tuple(g.shape)}, {tuple(beta.shape)}"
        )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm: bool,
    kernels: str = "auto",
) -> GatedDeltaOutput:
    """Prefill: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, <= 0) and beta [T, Hv], sequences
    packed by cu_seqlens int32 [N+1]; initial_state [N, Hv, Dk, Dv] fp32 or None (zeros).
    Returns o [T, Hv, Dv] in v's dtype and each sequence's final state [N, Hv, Dk, Dv] fp32."""
    _check_heads(q, k, v, g, beta)
    _check_devices(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError("cu_seqlens must be int32 [N+1]")
    shape = (cu_seqlens.shape[0] - 1, v.shape[1], k.shape[2], v.shape[2])
    if initial_state is not None and (
        initial_state.shape != shape or initial_state.dtype != torch.float32
    ):
        raise ValueError(
            f"initial_state must be fp32 {shape}, got {initial_state.dtype} "
            f"{tuple(initial_state.shape)}"
        )
    if _use_triton(q, kernels):
        from flotilla.kernels.gated_delta_chunk import chunk_gated_delta_rule_triton

        # fp32 models get the state walk and output at about fp32 accuracy (3 tf32 passes,
        # ~1.45x the time on an H100: relative state error 6e-7 instead of 8e-4); 16-bit ones
        # the single-pass tf32, finer than their inputs
        o, final = chunk_gated_delta_rule_triton(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
            precision="tf32x3" if v.dtype == torch.float32 else "tf32",
        )
    else:
        o, final = ref.chunk_gated_delta_rule_torch(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm
        )
    return GatedDeltaOutput(o, final)


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool,
    kernels: str = "auto",
) -> torch.Tensor:
    """Decode: one token per sequence, q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv]; the
    pool state [S, Hv, Dk, Dv] fp32 is updated in place at rows state_indices int32 [N]
    (< 0: padding, skipped). Returns o [N, Hv, Dv] in v's dtype."""
    _check_heads(q, k, v, g, beta)
    _check_devices(q, k, v, g, beta, state, state_indices)
    if (
        state.dim() != 4
        or state.shape[1:] != (v.shape[1], k.shape[2], v.shape[2])
        or (state.dtype != torch.float32)
    ):
        raise ValueError(
            f"state must be fp32 [S, {v.shape[1]}, {k.shape[2]}, {v.shape[2]}], "
            f"got {state.dtype} {tuple(state.shape)}"
        )
    if state_indices.shape != (q.shape[0],) or state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices must be int32 [{q.shape[0]}]")
    if _use_triton(q, kernels):
        from flotilla.kernels.gated_delta_recurrent import fused_recurrent_update_triton

        return fused_recurrent_update_triton(
            q, k, v, g, beta, scale, state, state_indices, use_qk_l2norm
        )
    return ref.fused_recurrent_gated_delta_rule_update_torch(
        q, k, v, g, beta, scale, state, state_indices, use_qk_l2norm
    )


def _check_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    rows: int,
) -> None:
    channels, width = weight.shape
    _check_devices(x, weight, bias, conv_state, state_indices)
    if x.dim() != 2 or x.shape[1] != channels:
        raise ValueError(f"x must be [T, {channels}], got {tuple(x.shape)}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias must be [{channels}]")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (channels, width - 1):
        raise ValueError(
            f"conv_state must be [S, {channels}, {width - 1}], got {tuple(conv_state.shape)}"
        )
    if state_indices.shape != (rows,) or state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices must be int32 [{rows}]")


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    kernels: str = "auto",
) -> torch.Tensor:
    """Prefill conv + SiLU: x [T, C], weight [C, W]; sequence i starts from
    conv_state[state_indices[i]] when has_initial_state[i] (bool [N]) else zeros, and its last
    W-1 inputs are written there. Returns y [T, C] in x's dtype."""
    rows = cu_seqlens.shape[0] - 1
    _check_conv(x, weight, bias, conv_state, state_indices, rows)
    _check_devices(x, cu_seqlens, has_initial_state)
    if cu_seqlens.dtype != torch.int32 or has_initial_state.shape != (rows,):
        raise ValueError("cu_seqlens must be int32 [N+1] and has_initial_state bool [N]")
    if _use_triton(x, kernels):
        return conv.causal_conv1d_varlen_triton(
            x, weight, bias, conv_state, state_indices, cu_seqlens, has_initial_state
        )
    return conv.causal_conv1d_varlen_torch(
        x, weight, bias, conv_state, state_indices, cu_seqlens, has_initial_state
    )


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    kernels: str = "auto",
) -> torch.Tensor:
    """Decode conv + SiLU: x [N, C], one token per sequence; shifts conv_state[state_indices[n]]
    in place. Returns y [N, C] in x's dtype."""
    _check_conv(x, weight, bias, conv_state, state_indices, x.shape[0])
    if _use_triton(x, kernels):
        return conv.causal_conv1d_update_triton(x, weight, bias, conv_state, state_indices)
    return conv.causal_conv1d_update_torch(x, weight, bias, conv_state, state_indices)
