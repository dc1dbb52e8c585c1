"""Fused rotary + KV-cache write against the two unfused references it replaces."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.kv_cache import write_kv_cache_ref
from flotilla.kernels.rotary import rotary_embedding_ref
from flotilla.kernels.rotary_kv import rotary_write_kv_cache_triton
from tests.kernels.conftest import DEVICE, tolerance
from tests.kernels.test_rotary import cos_sin_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rot_dim,block_size", [(64, 64, 16), (32, 16, 8), (128, 128, 4)])
def test_rotary_kv_matches_unfused_reference(
    dtype: torch.dtype, is_neox: bool, head_dim: int, rot_dim: int, block_size: int
) -> None:
    tokens, hq, hk, num_blocks = 9, 4, 2, 5
    qkv = torch.randn(tokens, hq + 2 * hk, head_dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]  # strided views
    pos = torch.randint(0, 100, (tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[[1, 6]] = -1  # padding rows: rotated q still returned, nothing written
    cache = cos_sin_cache(100, rot_dim).to(DEVICE)
    shape = (num_blocks, block_size, hk, head_dim)
    caches = torch.randn(2, *shape, dtype=dtype, device=DEVICE)
    ref_caches = caches.clone()
    q_before = q.clone()
    out_q = rotary_write_kv_cache_triton(pos, q, k, v, cache, is_neox, caches[0], caches[1], slots)
    ref_q, ref_k = rotary_embedding_ref(pos, q, k, cache, is_neox)
    write_kv_cache_ref(ref_k, v, ref_caches[0], ref_caches[1], slots)
    # Same fp32 arithmetic and roundings as the references (the GPU may fuse multiply-adds).
    torch.testing.assert_close(out_q, ref_q, **tolerance(dtype))
    torch.testing.assert_close(caches, ref_caches, **tolerance(dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(caches.flatten(1, 2)[:, untouched], ref_caches.flatten(1, 2)[:, untouched])
    assert torch.equal(q, q_before)


@pytest.mark.gpu
def test_rotary_kv_gpu_realistic() -> None:
    tokens, hq, hk, dim, bs = 4096, 32, 8, 128, 16
    qkv = torch.randn(tokens, hq + 2 * hk, dim, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    slots = torch.randperm(1024 * bs, device="cuda")[:tokens]
    cache = cos_sin_cache(8192, dim).cuda()
    caches = torch.zeros(2, 1024, bs, hk, dim, dtype=torch.bfloat16, device="cuda")
    ref_caches = caches.clone()
    out_q = rotary_write_kv_cache_triton(pos, q, k, v, cache, True, caches[0], caches[1], slots)
    ref_q, ref_k = rotary_embedding_ref(pos, q, k, cache, True)
    write_kv_cache_ref(ref_k, v, ref_caches[0], ref_caches[1], slots)
    torch.testing.assert_close(out_q, ref_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(caches, ref_caches, atol=2e-2, rtol=2e-2)
