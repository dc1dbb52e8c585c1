"""kernels/argmax.py: the Triton argmax of greedy rows against torch.argmax (ties, -inf rows,
strided rows)."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels.argmax import argmax_triton
from tests.kernels.conftest import DEVICE


def _argmax_cases(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows plus the edge cases: -inf rows, exact ties within and across chunks (of 16
    tokens), the maximum in the last, partial chunk, +inf."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(10, vocab, generator=g)
    logits[1] = float("-inf")
    logits[2] = 1.0  # all equal: index 0
    last = vocab - 1
    logits[3, [min(3, last), min(20, last), last]] = 9.0  # tie spanning chunks: 3
    logits[4, [min(5, last), min(17, last)]] = 9.0  # the later chunk's in-chunk offset is lower
    logits[5, : vocab // 2] = float("-inf")
    logits[5, [last, max(last - 1, 0)]] = 9.0  # tie in the last chunk
    logits[6, last] = float("inf")
    logits[7, :] = float("-inf")
    logits[7, last] = -1e30
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,block", [(37, 16), (64, 16), (1, None), (5, None), (300, 16),
                                         (1000, None), (5000, 1024)])
def test_argmax_matches_torch_with_ties_and_inf_rows(vocab: int, block: int | None,
                                                     dtype: torch.dtype) -> None:
    logits = _argmax_cases(vocab, dtype)
    out = argmax_triton(logits.to(DEVICE), block)
    assert out.dtype == torch.int64
    assert torch.equal(out.cpu(), logits.argmax(dim=-1))


def test_argmax_of_strided_rows_and_empty_batch() -> None:
    wide = _argmax_cases(80, torch.float32).to(DEVICE)
    view = wide[::2, 5:70]  # row stride 160, last dim contiguous
    assert torch.equal(argmax_triton(view, 16).cpu(), view.cpu().argmax(dim=-1))
    columns = wide[:, :37].t()  # last dim strided: copied first
    assert torch.equal(argmax_triton(columns, 16).cpu(), columns.cpu().argmax(dim=-1))
    assert argmax_triton(wide[:0], 16).shape == (0,)
    with pytest.raises(ValueError):
        argmax_triton(wide, 48)


@pytest.mark.gpu
def test_argmax_llama3_vocab_gpu() -> None:
    logits = torch.randn(16, 128256, device=DEVICE) * 4
    logits[3, [7, 60000, 128255]] = 50.0
    logits[4] = float("-inf")
    assert torch.equal(argmax_triton(logits), logits.argmax(dim=-1))
