"""Learned attention sinks (gpt-oss): the paged-attention reference against a naive softmax with
the sink logit appended (transformers' eager gpt-oss attention), and the Triton decode (one split
and several) and prefill kernels against that reference, with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.paged_attention import decode_attention_triton, paged_attention_ref
from flotilla.kernels.prefill_attention import prefill_attention_triton
from tests.kernels.attention_cases import AttentionCase, make_case
from tests.kernels.conftest import DEVICE, tolerance


def _sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Ordinary sink logits plus one far above any score (its head's weights all but vanish)."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[-1] = 40.0
    return sinks.to(DEVICE)


def naive_attention(case: AttentionCase, scale: float, window: int | None,
                    sinks: torch.Tensor | None, chunk: int | None = None) -> torch.Tensor:
    """Per sequence and head: scores, the sink logit appended, softmax, the sink column dropped
    (transformers' GptOss eager_attention_forward); `chunk`: keys of the query's chunk only
    (transformers' chunked_attention mask, k // chunk == q // chunk)."""
    meta, out = case.meta, torch.zeros(case.q.shape, dtype=torch.float32)
    block_size, num_kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    group = case.q.shape[1] // num_kv_heads
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        slots = [int(meta.block_tables[i, p // block_size]) * block_size + p % block_size
                 for p in range(seq_len)]
        k = case.k_cache.flatten(0, 1)[slots].float().cpu()
        v = case.v_cache.flatten(0, 1)[slots].float().cpu()
        for row in range(start, end):
            pos = seq_len - (end - row)
            visible = torch.arange(seq_len) <= pos
            if window is not None:
                visible &= torch.arange(seq_len) > pos - window
            if chunk is not None:
                visible &= torch.arange(seq_len) // chunk == pos // chunk
            for h in range(case.q.shape[1]):
                scores = (k[:, h // group] @ case.q[row, h].float().cpu()) * scale
                scores = scores.masked_fill(~visible, float("-inf"))
                sink = torch.tensor([float("-inf")]) if sinks is None else sinks[h].cpu()[None]
                logits = torch.cat([scores, sink.float()])
                probs = torch.softmax(logits - logits.max(), 0)[:-1]
                out[row, h] = probs @ v[:, h // group]
    return out


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_naive_softmax_with_sink(window: int | None) -> None:
    case = make_case([1, 7, 1, 12], [9, 20, 1, 12], 4, 2, 16, 8, torch.float32)
    sinks = _sinks(4)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.25, window,
                              sinks=sinks)
    torch.testing.assert_close(ref.cpu(), naive_attention(case, 0.25, window, sinks), atol=2e-5,
                               rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [None, 9])
def test_decode_kernel_with_sinks_matches_reference(dtype: torch.dtype, num_splits: int,
                                                    window: int | None) -> None:
    case = make_case([1] * 4, [1, 16, 17, 45], 4, 2, 32, 8, dtype, pad_rows=1)
    sinks = _sinks(4, seed=1)
    out = decode_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.3, window,
                                  num_splits=num_splits, block_n=16, sinks=sinks)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.3, window,
                              sinks=sinks)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_kernel_with_sinks_matches_reference(dtype: torch.dtype,
                                                     window: int | None) -> None:
    case = make_case([5, 1, 16, 17], [21, 16, 16, 17], 4, 2, 32, 8, dtype, pad_rows=2)
    sinks = _sinks(4, seed=2)
    out = prefill_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.3, window,
                                   block_m=16, block_n=16, sinks=sinks)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.3, window,
                              sinks=sinks)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_sinks_change_the_output() -> None:
    """Guards the tests above against a sink that is never applied."""
    case = make_case([1, 6], [10, 6], 4, 2, 16, 8, torch.float32)
    plain = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.3)
    sunk = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.3,
                               sinks=_sinks(4))
    assert (plain - sunk).abs().amax() > 0.05
