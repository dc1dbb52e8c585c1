"""Scatter the new tokens' K/V into the paged cache at their flat slots (slot -1 = skip)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[keep].to(v_cache.dtype))


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hk, D] new keys (head and token strides free, last dim contiguous)
    v_ptr,  # [T, Hk, D] new values
    k_cache_ptr,  # [num_blocks, block_size, Hk, D]
    v_cache_ptr,
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
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kct + h * stride_kch + d
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vct + h * stride_vch + d
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
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
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=2,
    )
