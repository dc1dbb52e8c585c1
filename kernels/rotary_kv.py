"""Rotary embedding fused with the KV-cache write: one launch instead of two per layer.

Rotates q (returned as a new contiguous tensor) and k by their positions, and scatters the rotated
k and the unchanged v into the paged cache at their slots (slot -1 = skip, as write_kv_cache).
The rotated k is not returned: attention reads keys from the cache. Same arithmetic as
rotary_embedding followed by write_kv_cache (rotation in fp32, rounded to k's dtype, then to the
cache's, or with `kv_scales` quantized to e4m3 per head row as kernels/kv_quant.py), so the two
paths agree bit for bit.
"""

from __future__ import annotations

import torch

from flotilla.kernels.kv_cache import write_kv_cache_ref
from flotilla.kernels.kv_quant import (
    KVScales,
    check_kv_scales,
    quantize,
    quantize_rows,
    scales_from_amax,
)
from flotilla.kernels.pdl import pdl_args, pdl_wait
from flotilla.kernels.rotary import (
    check_rotary_args,
    load_cos_sin,
    rotary_embedding_ref,
    rotate_heads,
    rotated_halves,
)
from flotilla.kernels.triton_compat import tl, triton


def rotary_write_kv_cache_ref(
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
) -> torch.Tensor:
    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox)
    write_kv_cache_ref(k_rot, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q_rot


@triton.jit
def _rotate_quantize_k(
    k_ptr, kc_ptr, k_scale_ptr,  # one token's keys, its cache row, its Hk scales
    stride_kh, stride_ch, num_heads, head_dim, rot_half, cos, sin,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, HAS_PASS: tl.constexpr,
):
    # The scale needs the whole rotated row first: amax over both halves and the pass-through.
    h = tl.arange(0, BLOCK_H)[:, None]
    o1, o2, i1, i2, mask = rotated_halves(k_ptr, stride_kh, num_heads, rot_half, cos, sin,
                                          IS_NEOX, BLOCK_H, BLOCK_R)
    o1 = o1.to(tl.float32)
    o2 = o2.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(o1), 1), tl.max(tl.abs(o2), 1))
    if HAS_PASS:
        p = 2 * rot_half + tl.arange(0, BLOCK_P)[None, :]
        pmask = (h < num_heads) & (p < head_dim)
        rest = tl.load(k_ptr + h * stride_kh + p, mask=pmask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(rest), 1))
    scale = scales_from_amax(amax)
    tl.store(kc_ptr + h * stride_ch + i1, quantize(o1, scale[:, None]), mask=mask)
    tl.store(kc_ptr + h * stride_ch + i2, quantize(o2, scale[:, None]), mask=mask)
    if HAS_PASS:
        tl.store(kc_ptr + h * stride_ch + p, quantize(rest, scale[:, None]), mask=pmask)
    heads = tl.arange(0, BLOCK_H)
    tl.store(k_scale_ptr + heads, scale, mask=heads < num_heads)


@triton.jit
def _rotary_kv_kernel(
    pos_ptr,  # int64 [T] positions
    slot_ptr,  # int64 [T] flat cache slot = block * BLOCK_SIZE + offset; < 0 skips the K/V write
    q_ptr, k_ptr, v_ptr,  # [T, Hq, D], [T, Hk, D], [T, Hk, D]; token/head strides free
    q_out_ptr,  # [T, Hq, D] contiguous
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hk, D], sharing strides
    k_scale_ptr, v_scale_ptr,  # KV_FP8: fp32 [num_blocks * BLOCK_SIZE, Hk] (else unused)
    cache_ptr,  # fp32 [max_pos, 2 * rot_half] contiguous: cos then sin
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,  # cache strides: block, token, head
    num_q_heads, num_k_heads, head_dim, rot_half,
    IS_NEOX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,  # next power of two >= Hq
    BLOCK_HK: tl.constexpr,  # next power of two >= Hk
    BLOCK_R: tl.constexpr,  # next power of two >= rot_half
    BLOCK_P: tl.constexpr,  # pass-through width (rot_dim < D), else 1
    BLOCK_D: tl.constexpr,  # next power of two >= D
    HAS_PASS: tl.constexpr,
    KV_FP8: tl.constexpr,  # e4m3 caches: quantize each k / v head row with its own scale
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py)
):
    # One program per token: its cos/sin are read once; q heads go to q_out, k and v heads to
    # the cache slot of the token.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)  # the step's metadata and the cos/sin table: before the wait
    slot = tl.load(slot_ptr + t)
    cos, sin = load_cos_sin(cache_ptr, pos, rot_half, BLOCK_R)
    pdl_wait(USE_PDL)
    rotate_heads(
        q_ptr + t * stride_qt, q_out_ptr + t * num_q_heads * head_dim, stride_qh, head_dim,
        num_q_heads, head_dim, rot_half, cos, sin, IS_NEOX, BLOCK_HQ, BLOCK_R, BLOCK_P, HAS_PASS,
    )
    if slot >= 0:
        row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        h = tl.arange(0, BLOCK_HK)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_k_heads) & (d < head_dim)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        if KV_FP8:
            _rotate_quantize_k(
                k_ptr + t * stride_kt, k_cache_ptr + row, k_scale_ptr + slot * num_k_heads,
                stride_kh, stride_ch, num_k_heads, head_dim, rot_half, cos, sin,
                IS_NEOX, BLOCK_HK, BLOCK_R, BLOCK_P, HAS_PASS,
            )
            vq, v_scale = quantize_rows(v.to(tl.float32))
            tl.store(v_cache_ptr + row + h * stride_ch + d, vq, mask=mask)
            heads = tl.arange(0, BLOCK_HK)
            tl.store(v_scale_ptr + slot * num_k_heads + heads, v_scale, mask=heads < num_k_heads)
        else:
            rotate_heads(
                k_ptr + t * stride_kt, k_cache_ptr + row, stride_kh, stride_ch,
                num_k_heads, head_dim, rot_half, cos, sin, IS_NEOX, BLOCK_HK, BLOCK_R, BLOCK_P,
                HAS_PASS,
            )
            tl.store(v_cache_ptr + row + h * stride_ch + d,
                     v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_write_kv_cache_triton(
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
    pdl: str = "auto",
) -> torch.Tensor:
    check_rotary_args(positions, q, k, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)}, last dim contiguous")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_k_heads, head_dim):
        raise ValueError(f"caches {tuple(k_cache.shape)} do not match k {tuple(k.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError("slot_mapping must be int64 [T]")
    check_kv_scales(k_cache, v_cache, kv_scales)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    rot_dim = cos_sin_cache.shape[1]
    rot_half = rot_dim // 2
    k_scale, v_scale = kv_scales if kv_scales is not None else (k_cache, v_cache)
    _rotary_kv_kernel[(num_tokens,)](
        positions, slot_mapping, q, k, v, q_out, k_cache, v_cache, k_scale, v_scale,
        cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q_heads, num_k_heads, head_dim, rot_half,
        IS_NEOX=is_neox,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_R=triton.next_power_of_2(rot_half),
        BLOCK_P=triton.next_power_of_2(max(head_dim - rot_dim, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_PASS=rot_dim < head_dim,
        KV_FP8=kv_scales is not None,
        **pdl_args(q, pdl),
        num_warps=4,
    )
    return q_out
