"""Split-KV decode kernel and the paged_attention entry point against the torch reference."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.paged_attention import (
    ONE_SPLIT_PROGRAMS,
    SHORT_SPLIT_KEYS,
    decode_attention_triton,
    default_num_splits,
    paged_attention_ref,
    paged_attention_triton,
)
from flotilla.kernels.prefill_attention import prefill_attention_ref
from tests.kernels.attention_cases import make_case
from tests.kernels.conftest import DEVICE, tolerance

# Decode seq_lens: one token, exactly one block, one past, several blocks (block size 16 or 8).
SEQ_LENS = [1, 16, 17, 45]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference(dtype: torch.dtype, group: int, num_splits: int) -> None:
    case = make_case([1] * 4, SEQ_LENS, 2 * group, 2, 32, 16, dtype, pad_rows=1)
    out = decode_attention_triton(
        case.q, case.k_cache, case.v_cache, case.meta, 0.3, num_splits=num_splits, block_n=16
    )
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.3)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("block_size,head_dim", [(8, 64), (32, 128)])
@pytest.mark.parametrize("window,softcap", [(None, None), (9, None), (None, 4.0), (20, 8.0)])
def test_decode_block_sizes_window_softcap(
    block_size: int, head_dim: int, window: int | None, softcap: float | None
) -> None:
    case = make_case([1] * 3, [8, 33, 70], 4, 2, head_dim, block_size, torch.float16)
    out = decode_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.1, window,
                                  softcap, num_splits=2)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.1, window, softcap)
    torch.testing.assert_close(out, ref, **tolerance(torch.float16))


def test_decode_skips_sequences_without_new_tokens() -> None:
    case = make_case([1, 0, 1], [5, 9, 20], 2, 1, 32, 8, torch.float32)
    out = decode_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.2,
                                  num_splits=2, block_n=16)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_writes_nothing_for_a_last_sequence_without_new_tokens(num_splits: int) -> None:
    # The skipped sequence's query_start_loc points at the zeroed padding row: a store that
    # is not masked out (split kernel or reduce kernel) would land there.
    case = make_case([1, 1, 0], [5, 20, 9], 4, 2, 32, 8, torch.float32, pad_rows=1)
    out = decode_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.2,
                                  num_splits=num_splits, block_n=16)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_default_splits_for_short_context_bounds() -> None:
    # Short-context CUDA graphs (services/engine/cuda_graphs.py) pass the bound as max_seq_len:
    # one 64-key tile per split while latency-bound, one split (no reduce) from ~the SM count of
    # programs; long bounds keep >= 256 keys per split.
    assert SHORT_SPLIT_KEYS == 512 and ONE_SPLIT_PROGRAMS == 128
    assert default_num_splits(1, 8, 512) == 8
    assert default_num_splits(1, 8, 128) == 2
    assert default_num_splits(4, 8, 512) == 8
    assert default_num_splits(16, 8, 512) == 1
    assert default_num_splits(16, 4, 512) == 8
    assert default_num_splits(1, 8, 8192) == 32
    assert default_num_splits(16, 8, 8192) == 4
    assert default_num_splits(1, 8, 513) == 4


# (batch, KV heads): 8 splits of one tile each; 128 programs -> one split, no reduce kernel.
@pytest.mark.parametrize("batch,num_kv_heads,splits", [(1, 8, 8), (16, 8, 1)])
def test_decode_at_the_short_context_bound_matches_reference(
    batch: int, num_kv_heads: int, splits: int
) -> None:
    g = torch.Generator().manual_seed(batch)
    seq_lens = [SHORT_SPLIT_KEYS, *torch.randint(1, SHORT_SPLIT_KEYS + 1, (batch - 1,),
                                                 generator=g).tolist()]
    case = make_case([1] * batch, seq_lens, num_kv_heads, num_kv_heads, 32, 16, torch.bfloat16,
                     pad_rows=1)
    case.meta.max_seq_len = SHORT_SPLIT_KEYS  # the short graphs' bound
    assert default_num_splits(batch, num_kv_heads, SHORT_SPLIT_KEYS) == splits
    out = decode_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


def test_paged_attention_mixed_batch_dispatch() -> None:
    case = make_case([1, 6, 1, 17], [30, 6, 1, 40], 4, 1, 32, 16, torch.bfloat16)
    out = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


# Equal lengths (a batch of one included) take the unmasked fast path of the decode reference.
@pytest.mark.parametrize("seq_lens", [[1, 8, 9, 30, 64], [20, 20, 20], [37]])
@pytest.mark.parametrize("window,softcap", [(None, None), (3, 2.0)])
def test_batched_decode_ref_matches_per_sequence_ref(
    window: int | None, softcap: float | None, seq_lens: list[int]
) -> None:
    case = make_case([1] * len(seq_lens), seq_lens, 6, 3, 32, 8, torch.float32)
    batched = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.2, window,
                                  softcap)
    per_seq = prefill_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.2, window,
                                    softcap)
    torch.testing.assert_close(batched, per_seq)


def test_reference_matches_naive_attention() -> None:
    case = make_case([2, 1], [5, 3], 4, 2, 8, 2, torch.float32)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.5, 3, 2.0)
    k_flat = case.k_cache.flatten(0, 1)
    v_flat = case.v_cache.flatten(0, 1)
    for i, (q_len, seq_len) in enumerate([(2, 5), (1, 3)]):
        table = case.meta.block_tables[i].long()
        pos_ids = torch.arange(seq_len, device=table.device)
        slots = table[pos_ids // 2] * 2 + pos_ids % 2
        for j in range(q_len):
            pos = seq_len - q_len + j
            row = case.meta.query_start_loc_cpu[i] + j
            for h in range(4):
                scores = (k_flat[slots, h // 2] @ case.q[row, h]) * 0.5
                scores = 2.0 * torch.tanh(scores / 2.0)
                visible = (pos_ids <= pos) & (pos_ids > pos - 3)
                weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), 0)
                torch.testing.assert_close(ref[row, h], weights @ v_flat[slots, h // 2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (3, 64), (8, 128)])
def test_decode_gpu_realistic(dtype: torch.dtype, group: int, head_dim: int) -> None:
    seq_lens = torch.randint(1, 4096, (64,)).tolist()
    case = make_case([1] * 64, seq_lens, 8 * group, 8, head_dim, 16, dtype)
    out = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, head_dim**-0.5)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, head_dim**-0.5)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    assert DEVICE == "cuda"
