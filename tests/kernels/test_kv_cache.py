"""write_kv_cache kernel: scatters each token to its slot, skips -1, touches nothing else."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.kv_cache import write_kv_cache_ref, write_kv_cache_triton
from tests.kernels.conftest import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_heads,head_dim", [(16, 2, 64), (8, 3, 32), (32, 1, 128)])
def test_write_kv_cache_matches_reference(
    dtype: torch.dtype, block_size: int, num_heads: int, head_dim: int
) -> None:
    num_blocks, tokens = 6, 11
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[[2, 7]] = -1  # padding rows must not be written
    qkv = torch.randn(tokens, 3 * num_heads, head_dim, dtype=dtype, device=DEVICE)
    k, v = qkv[:, num_heads : 2 * num_heads], qkv[:, 2 * num_heads :]  # strided views
    shape = (num_blocks, block_size, num_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    write_kv_cache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    flat = k_cache.view(-1, num_heads, head_dim)
    assert torch.equal(flat[slots[0]], k[0])


def test_write_kv_cache_ref_skips_negative_slots() -> None:
    k = torch.ones(2, 1, 4)
    cache = torch.zeros(1, 4, 1, 4)
    write_kv_cache_ref(k, k, cache, cache.clone(), torch.tensor([3, -1]))
    assert cache[0, 3].sum() == 4 and cache[0, :3].sum() == 0


@pytest.mark.gpu
def test_write_kv_cache_gpu_realistic() -> None:
    tokens, heads, dim, bs = 4096, 8, 128, 16
    k = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(8192 * bs, device="cuda")[:tokens]
    caches = [torch.zeros(8192, bs, heads, dim, dtype=torch.bfloat16, device="cuda")
              for _ in range(4)]
    write_kv_cache_triton(k, v, caches[0], caches[1], slots)
    write_kv_cache_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
