"""Scatter the new tokens' K/V into the paged cache at their flat slots (slot -1 = skip).

With `kv_scales` the caches are e4m3 and each (token, head) row is quantized on the way in with
its own scale (kernels/kv_quant.py).
"""

from __future__ import annotations

import torch

from flotilla.kernels.kv_quant import KVScales, check_kv_scales, quantize_kv_ref, quantize_rows
from flotilla.kernels.triton_compat import tl, triton


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping
    if slots.numel() and int(slots.min()) < 0:  # padding rows: select (a sync) only if present
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    if kv_scales is None:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    for x, cache, scales in ((k, k_cache, kv_scales.k), (v, v_cache, kv_scales.v)):
        q, scale = quantize_kv_ref(x)
        # index_copy_ has no float8 kernel on every backend: copy the bytes.
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slots, q.view(torch.uint8))
        scales.view(-1, num_kv_heads).index_copy_(0, slots, scale)


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hk, D] new keys (head and token strides free, last dim contiguous)
    v_ptr,  # [T, Hk, D] new values
    k_cache_ptr,  # [num_blocks, block_size, Hk, D]
    v_cache_ptr,
    k_scale_ptr, v_scale_ptr,  # KV_FP8: fp32 [num_blocks * block_size, Hk] (else unused)
    slot_ptr,  # int64 [T] flat slot = block * block_size + offset; < 0 skips the token
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,  # k cache strides: block, token, head
    stride_vcb, stride_vct, stride_vch,
    num_heads,  # Hk
    head_dim,  # D
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # next power of two >= Hk
    BLOCK_D: tl.constexpr,  # next power of two >= D
    KV_FP8: tl.constexpr,  # e4m3 caches: quantize each head row with its own scale
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kct + h * stride_kch + d
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vct + h * stride_vch + d
    if KV_FP8:
        kq, k_scale = quantize_rows(k.to(tl.float32))
        vq, v_scale = quantize_rows(v.to(tl.float32))
        tl.store(kc, kq, mask=mask)
        tl.store(vc, vq, mask=mask)
        heads = tl.arange(0, BLOCK_H)
        tl.store(k_scale_ptr + slot * num_heads + heads, k_scale, mask=heads < num_heads)
        tl.store(v_scale_ptr + slot * num_heads + heads, v_scale, mask=heads < num_heads)
    else:
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_heads, head_dim):
        raise ValueError(f"caches {tuple(k_cache.shape)} do not match k {tuple(k.shape)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError("slot_mapping must be int64 [T]")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    check_kv_scales(k_cache, v_cache, kv_scales)
    if num_tokens == 0:
        return
    k_scale, v_scale = kv_scales if kv_scales is not None else (k_cache, v_cache)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=kv_scales is not None,
        num_warps=2,
    )
