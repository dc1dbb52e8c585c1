"""Gated DeltaNet decode step: one token per sequence against a pool of recurrent states.

One program per (sequence, value head, block of BV value columns) holds its [Dk, BV] slice of
the fp32 state in registers: decay by exp(g), read the prediction S^T k, write the delta-rule
correction k (beta (v - S^T k))^T, emit o = S^T (scale q), and store the slice back in place.
The slices of one state are independent (every step is column-wise in Dv), so the Dv split
needs no communication. Padding rows (slot < 0) write zeros to o and leave the pool alone.
The math: kernels/gated_delta_torch.py (the reference, `..._update_torch`).
"""

from __future__ import annotations

import torch

from flotilla.kernels.triton_compat import tl, triton


@triton.jit
def _recurrent_update_kernel(
    q_ptr,  # [N, Hk, Dk] queries (last dim contiguous)
    k_ptr,  # [N, Hk, Dk] keys
    v_ptr,  # [N, Hv, Dv] values
    g_ptr,  # [N, Hv] log decay
    beta_ptr,  # [N, Hv]
    state_ptr,  # [S, Hv, Dk, Dv] fp32 pool, each slot contiguous; updated in place
    slot_ptr,  # int32 [N] pool row of each sequence, < 0: padding
    o_ptr,  # [N, Hv, Dv] output, contiguous
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_gn,
    stride_bn,
    stride_slot,
    scale,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GROUP: tl.constexpr,  # Hv // Hk: value heads per key head
    BK: tl.constexpr,  # next power of two >= Dk
    BV: tl.constexpr,  # value columns per program
    USE_L2: tl.constexpr,  # l2-normalise q and k first
):
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_v = offs_v < DV
    o_ptrs = o_ptr + (n * HV + hv) * DV + offs_v
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0:
        tl.store(o_ptrs, tl.zeros([BV], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=mask_v)
        return
    hk = hv // GROUP
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < DK
    q = tl.load(q_ptr + n * stride_qn + hk * stride_qh + offs_k, mask=mask_k, other=0.0)
    k = tl.load(k_ptr + n * stride_kn + hk * stride_kh + offs_k, mask=mask_k, other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    if USE_L2:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    v = tl.load(v_ptr + n * stride_vn + hv * stride_vh + offs_v, mask=mask_v, other=0.0)
    g = tl.load(g_ptr + n * stride_gn + hv).to(tl.float32)
    beta = tl.load(beta_ptr + n * stride_bn + hv).to(tl.float32)
    s_ptrs = state_ptr + slot * stride_slot + hv * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    s_mask = mask_k[:, None] & mask_v[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0) * tl.exp(g)
    predicted = tl.sum(s * k[:, None], axis=0)
    delta = (v.to(tl.float32) - predicted) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(s_ptrs, s, mask=s_mask)
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fused_recurrent_update_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool,
    block_v: int = 32,
) -> torch.Tensor:
    """Launch over (N, Hv, Dv / block_v); shapes checked by kernels/gated_delta.py."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if state.stride()[1:] != (dk * dv, dv, 1):
        raise ValueError("each state pool slot must be contiguous [Hv, Dk, Dv]")
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    g, beta = _rows_contiguous(g), _rows_contiguous(beta)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    bv = min(block_v, triton.next_power_of_2(dv))
    if n > 0:
        _recurrent_update_kernel[(n, hv, triton.cdiv(dv, bv))](
            q,
            k,
            v,
            g,
            beta,
            state,
            state_indices,
            o,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            g.stride(0),
            beta.stride(0),
            state.stride(0),
            scale,
            HV=hv,
            DK=dk,
            DV=dv,
            GROUP=hv // hk,
            BK=triton.next_power_of_2(dk),
            BV=bv,
            USE_L2=use_qk_l2norm,
            num_warps=4,
        )
    return o
