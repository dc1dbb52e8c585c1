"""Prefill/extend attention kernel against the torch reference on ragged paged batches."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from tests.kernels.attention_cases import bounds_only, make_case
from tests.kernels.conftest import DEVICE, tolerance

# (q_lens, seq_lens, block_size): chunked prefill on a cached prefix, a whole prompt, a decode
# row inside a mixed batch, and lengths exactly at / one past / one short of a block boundary.
BATCHES = [
    ([5, 1, 16, 17], [21, 16, 16, 17], 16),
    ([1, 9, 8, 3], [1, 33, 8, 31], 8),
    ([20, 1], [52, 33], 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_lens,seq_lens,block_size", BATCHES)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_matches_reference(
    dtype: torch.dtype, q_lens: list[int], seq_lens: list[int], block_size: int, group: int
) -> None:
    case = make_case(q_lens, seq_lens, 2 * group, 2, 32, block_size, dtype, pad_rows=2)
    out = prefill_attention_triton(
        case.q, case.k_cache, case.v_cache, case.meta, 0.3, block_m=16, block_n=16
    )
    ref = prefill_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.3)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("window,softcap", [(7, None), (None, 5.0), (16, 10.0)])
def test_prefill_window_and_softcap(window: int | None, softcap: float | None) -> None:
    case = make_case([12, 1, 30], [40, 19, 30], 4, 1, 64, 16, torch.float16)
    out = prefill_attention_triton(
        case.q, case.k_cache, case.v_cache, case.meta, 0.125, window, softcap,
        block_m=16, block_n=16,
    )
    ref = prefill_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.125, window,
                                softcap)
    torch.testing.assert_close(out, ref, **tolerance(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,seq_lens,block_m", [
    ([5, 1, 16, 17], [21, 16, 16, 17], 16),  # blocks start mid-tile: 5 + 1 -> the 16s straddle
    ([1, 1, 40, 1], [9, 33, 40, 70], 16),  # decode rows around a prompt of 3 tiles
    ([33, 2], [33, 50], 32),
    ([64], [64], 64),  # exactly one tile
])
@pytest.mark.parametrize("extra_seqs", [0, 5])
def test_prefill_bounds_only_grid(dtype: torch.dtype, q_lens: list[int], seq_lens: list[int],
                                  block_m: int, extra_seqs: int) -> None:
    """The graph-safe launch (no host value of the step): every real row as the reference,
    padding rows and empty sequences harmless, padding rows zero."""
    case = make_case(q_lens, seq_lens, 4, 2, 32, 8, dtype, pad_rows=11)
    meta = bounds_only(case.meta, extra_seqs)
    out = prefill_attention_triton(case.q, case.k_cache, case.v_cache, meta, 0.3,
                                   block_m=block_m, block_n=16)
    ref = prefill_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.3)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    assert not out[sum(q_lens):].any()


def test_prefill_default_tiles_head_dim_128() -> None:
    case = make_case([3, 70], [35, 70], 2, 1, 128, 16, torch.bfloat16)
    out = prefill_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, 0.09)
    ref = prefill_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.09)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_gpu_realistic(dtype: torch.dtype, head_dim: int) -> None:
    q_lens = [512, 1, 1000, 37, 2048]
    seq_lens = [512, 700, 1800, 4133, 2048]
    case = make_case(q_lens, seq_lens, 32, 8, head_dim, 16, dtype)
    out = prefill_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, head_dim**-0.5)
    ref = prefill_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, head_dim**-0.5)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    assert DEVICE == "cuda"
