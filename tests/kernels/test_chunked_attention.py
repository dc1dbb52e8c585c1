"""Chunked (local) attention (llama4's rope layers): a token sees only the keys of its own chunk
of `attention_chunk` positions. The paged-attention reference against a naive masked softmax
(transformers' chunked mask), and the Triton decode and prefill kernels against the reference,
with chunks shorter than the sequences, prefill chunks crossing a chunk boundary, and decode rows
on the first position of a chunk."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.paged_attention import decode_attention_triton, paged_attention_ref
from flotilla.kernels.prefill_attention import prefill_attention_triton
from tests.kernels.attention_cases import make_case
from tests.kernels.conftest import tolerance
from tests.kernels.test_attention_sinks import naive_attention


def test_reference_matches_naive_chunked_mask() -> None:
    case = make_case([1, 7, 1, 12, 5], [9, 20, 1, 12, 16], 4, 2, 16, 8, torch.float32)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.25,
                              attention_chunk=6)
    torch.testing.assert_close(ref.cpu(), naive_attention(case, 0.25, None, None, chunk=6),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_kernel_with_chunks_matches_reference(dtype: torch.dtype, num_splits: int) -> None:
    # seq_len 17 / 41: the new token is the first of its chunk (16 / 40 are multiples of 8)
    case = make_case([1] * 5, [1, 17, 23, 41, 45], 4, 2, 32, 8, dtype)
    out = decode_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.3,
                                  num_splits=num_splits, block_n=16, attention_chunk=8)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.3,
                              attention_chunk=8)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [5, 16])
def test_prefill_kernel_with_chunks_matches_reference(dtype: torch.dtype, chunk: int) -> None:
    case = make_case([5, 1, 16, 17, 30], [21, 16, 16, 17, 40], 4, 2, 32, 8, dtype)
    out = prefill_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.3,
                                   block_m=16, block_n=16, attention_chunk=chunk)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.3,
                              attention_chunk=chunk)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_window_and_chunk_together_are_refused() -> None:
    case = make_case([3], [3], 2, 1, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="not both"):
        prefill_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.3, 4,
                                 attention_chunk=4)
