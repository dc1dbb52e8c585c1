"""MLA (absorbed, latent-cache) decode and extend kernels against the torch reference, and the
reference against decompressed per-head attention (the form transformers computes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from flotilla.kernels.mla_attention import (
    mla_attention_ref,
    mla_attention_triton,
    mla_decode_triton,
    mla_extend_triton,
)
from flotilla.services.engine.forward_context import AttentionMetadata
from tests.kernels.attention_cases import make_case
from tests.kernels.conftest import DEVICE, tolerance
from tests.kernels.sm90_report import needs_ptxas, sm90_report


class MLACase(NamedTuple):
    q_lat: torch.Tensor  # [T, H, R]
    q_pe: torch.Tensor  # [T, H, P]
    cache: torch.Tensor  # [N, bs, 1, R + P]
    meta: AttentionMetadata


def mla_case(q_lens: list[int], seq_lens: list[int], heads: int, rank: int, rope: int,
             block_size: int, dtype: torch.dtype, pad_rows: int = 0) -> MLACase:
    """Random queries and a cache whose sequences' blocks are scattered over spare blocks."""
    case = make_case(q_lens, seq_lens, heads, 1, rank + rope, block_size, dtype, pad_rows)
    q_lat, q_pe = case.q.split([rank, rope], dim=-1)
    return MLACase(q_lat.contiguous(), q_pe.contiguous(), case.k_cache, case.meta)


# Decode seq_lens: one token, exactly one block, one past, several blocks (block size 16).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 20])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference(dtype: torch.dtype, heads: int, num_splits: int) -> None:
    q_lat, q_pe, cache, meta = mla_case([1] * 4, [1, 16, 17, 45], heads, 32, 16, 16, dtype,
                                        pad_rows=1)
    out = mla_decode_triton(q_lat, q_pe, cache, meta, 0.2, num_splits=num_splits, block_n=16)
    ref = mla_attention_ref(q_lat, q_pe, cache, meta, 0.2)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_decode_odd_rank_and_sequence_without_token() -> None:
    # kv_lora_rank / rope dims that are not powers of two; sequence 1 has no new token.
    q_lat, q_pe, cache, meta = mla_case([1, 0, 1], [5, 9, 40], 3, 24, 8, 8, torch.float32)
    out = mla_decode_triton(q_lat, q_pe, cache, meta, 0.3, num_splits=2, block_n=16)
    torch.testing.assert_close(out, mla_attention_ref(q_lat, q_pe, cache, meta, 0.3),
                               **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_t", [1, 4])
def test_extend_matches_reference(dtype: torch.dtype, block_t: int) -> None:
    # Whole prompts, prefill over a cached prefix (chunked), decode rows in the same batch.
    q_lat, q_pe, cache, meta = mla_case([7, 1, 13, 1, 20], [7, 33, 30, 1, 20], 6, 32, 16, 8,
                                        dtype, pad_rows=2)
    out = mla_extend_triton(q_lat, q_pe, cache, meta, 0.25, block_t=block_t, block_n=16)
    ref = mla_attention_ref(q_lat, q_pe, cache, meta, 0.25)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_dispatch_mixed_batch() -> None:
    q_lat, q_pe, cache, meta = mla_case([1, 5], [17, 9], 4, 32, 16, 16, torch.bfloat16)
    out = mla_attention_triton(q_lat, q_pe, cache, meta, 0.2)
    torch.testing.assert_close(out, mla_attention_ref(q_lat, q_pe, cache, meta, 0.2),
                               **tolerance(torch.bfloat16))


def test_reference_equals_decompressed_attention() -> None:
    """Absorbed scores/outputs equal per-head attention over k = [c W_UK^T | k_pe], v = c W_UV^T
    (the weight-absorption identity the kernels rely on)."""
    heads, nope, rope, v_dim, rank, seq_len = 3, 8, 4, 6, 16, 11
    gen = torch.Generator().manual_seed(0)
    w_uk = torch.randn(heads, nope, rank, generator=gen, dtype=torch.float64)
    w_uv = torch.randn(heads, v_dim, rank, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(4, heads, nope, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(4, heads, rope, generator=gen, dtype=torch.float64)
    c = torch.randn(seq_len, rank, generator=gen, dtype=torch.float64)
    k_pe = torch.randn(seq_len, rope, generator=gen, dtype=torch.float64)
    cache = torch.cat([c, k_pe], -1).view(seq_len, 1, 1, rank + rope)  # block_size 1
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 4]), seq_lens=torch.tensor([seq_len]),
        block_tables=torch.arange(seq_len)[None], slot_mapping=torch.zeros(4),
        max_query_len=4, max_seq_len=seq_len, query_start_loc_cpu=[0, 4],
        seq_lens_cpu=[seq_len])
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
    got = torch.einsum("thr,hvr->thv", mla_attention_ref(q_lat, q_pe, cache, meta, 0.3), w_uv)
    k = torch.cat([torch.einsum("lr,hdr->hld", c, w_uk),
                   k_pe[None].expand(heads, -1, -1)], -1)
    v = torch.einsum("lr,hvr->hlv", c, w_uv)
    q = torch.cat([q_nope, q_pe], -1).transpose(0, 1)  # [H, 4, D]
    mask = torch.ones(4, seq_len, dtype=torch.bool).tril(seq_len - 4)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    # the reference computes in fp32
    torch.testing.assert_close(got, want.transpose(0, 1), atol=1e-5, rtol=1e-5)


def _time_us(fn: Callable[[], object], iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_deepseek_v3_sizes(heads: int) -> None:
    """kv_lora_rank 512, rope 64, bf16, ragged lengths up to 4k: decode and extend vs the
    reference; prints kernel times."""
    torch.manual_seed(0)
    lens = [1, 64, 511, 1500, 4097, 300, 2048, 17]
    q_lat, q_pe, cache, meta = mla_case([1] * len(lens), lens, heads, 512, 64, 16,
                                        torch.bfloat16)
    scale = 192**-0.5
    ref = mla_attention_ref(q_lat, q_pe, cache, meta, scale)
    out = mla_decode_triton(q_lat, q_pe, cache, meta, scale)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))
    decode_us = _time_us(lambda: mla_decode_triton(q_lat, q_pe, cache, meta, scale))

    q_lens = [1, 64, 200, 1500, 97, 300, 2048, 17]
    xq_lat, xq_pe, xcache, xmeta = mla_case(q_lens, lens, heads, 512, 64, 16, torch.bfloat16)
    ref = mla_attention_ref(xq_lat, xq_pe, xcache, xmeta, scale)
    out = mla_extend_triton(xq_lat, xq_pe, xcache, xmeta, scale)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))
    extend_us = _time_us(lambda: mla_extend_triton(xq_lat, xq_pe, xcache, xmeta, scale), 5)
    print(f"MLA H={heads} R=512 P=64 bf16 ({DEVICE}): decode batch {len(lens)} "
          f"{decode_us:.1f} us, extend {sum(q_lens)} tokens {extend_us:.1f} us")


@pytest.mark.slow
@needs_ptxas
def test_mla_kernels_compile_for_sm90_without_spills() -> None:
    spills = sm90_report("tests.kernels.mla_sm90", timeout=600)
    assert len(spills) == 3
    assert {name: n for name, n in spills.items() if n} == {}
