"""Sampling helpers: seeded race kernel == reference, right distribution, filters vs naive loops."""

from __future__ import annotations

import pytest
import torch

from kernels.sampling import (
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p_min_p,
    argmax_triton,
    sample_ref,
    sample_triton,
    token_counts,
)
from tests.kernels.conftest import DEVICE


@pytest.mark.parametrize("vocab", [37, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_kernel_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    logits = (torch.randn(6, vocab, device=DEVICE) * 3).to(dtype)
    logits[2, 10:] = float("-inf")  # a row filtered down to 10 tokens
    seeds = torch.tensor([0, 1, 2**40 + 7, -5, 123, 123], device=DEVICE)
    steps = torch.tensor([0, 0, 3, 9, 4, 5], device=DEVICE)
    out = sample_triton(logits, seeds, steps)
    assert torch.equal(out, sample_ref(logits, seeds, steps))
    assert out[2] < 10


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


def test_sample_is_reproducible_per_seed_and_step() -> None:
    logits = torch.zeros(1, 1000).expand(64, -1)
    seeds = torch.full((64,), 42)
    steps = torch.arange(64)
    first = sample_ref(logits, seeds, steps)
    assert torch.equal(first, sample_ref(logits, seeds, steps))
    assert first.unique().numel() > 50  # different steps draw different tokens
    # A row's draw does not depend on the other rows in the batch.
    assert sample_ref(logits[:1], seeds[5:6], steps[5:6]).item() == first[5].item()


def test_sample_follows_the_softmax_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 40000
    logits = probs.log()[None].expand(n, -1)
    tokens = sample_ref(logits, torch.full((n,), 7), torch.arange(n))
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)


def test_top_k_top_p_min_p_match_naive_filters() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 2
    top_k = torch.tensor([0, 5, 0, 0, 3])
    top_p = torch.tensor([1.0, 1.0, 0.7, 1.0, 0.5])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.1])
    out = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    for i in range(5):
        keep = torch.ones(50, dtype=torch.bool)
        if top_k[i] > 0:
            keep &= logits[i] >= logits[i].topk(int(top_k[i])).values[-1]
        probs = logits[i].masked_fill(~keep, float("-inf")).softmax(0)
        sorted_p, order = probs.sort(descending=True)
        in_nucleus = torch.zeros(50, dtype=torch.bool)
        total = 0.0
        for p, idx in zip(sorted_p.tolist(), order.tolist(), strict=True):
            if total >= top_p[i]:
                break
            in_nucleus[idx] = True
            total += p
        keep &= in_nucleus
        keep &= probs >= min_p[i] * probs.max()
        expected = logits[i].masked_fill(~keep, float("-inf"))
        torch.testing.assert_close(out[i], expected)


def test_penalties_match_naive_loop() -> None:
    logits = torch.randn(2, 8)
    prompt = torch.tensor([[1, 2, -1], [7, -1, -1]])
    output = torch.tensor([[2, 2, 5], [0, 7, -1]])
    rep, pres, freq = torch.tensor([1.5, 1.0]), torch.tensor([0.5, 0.0]), torch.tensor([0.1, 1.0])
    prompt_mask = token_counts(prompt, 8) > 0
    out = apply_penalties(logits, prompt_mask, token_counts(output, 8), rep, pres, freq)
    expected = logits.clone()
    for b in range(2):
        seen = {t for t in prompt[b].tolist() + output[b].tolist() if t >= 0}
        for t in seen:
            x = expected[b, t]
            expected[b, t] = x / rep[b] if x > 0 else x * rep[b]
        for t in {t for t in output[b].tolist() if t >= 0}:
            count = output[b].tolist().count(t)
            expected[b, t] -= pres[b] + freq[b] * count
    torch.testing.assert_close(out, expected)


def test_temperature_leaves_greedy_rows() -> None:
    logits = torch.tensor([[2.0, 4.0], [2.0, 4.0]])
    out = apply_temperature(logits, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(out, torch.tensor([[4.0, 8.0], [2.0, 4.0]]))


@pytest.mark.gpu
def test_sample_kernel_gpu_realistic() -> None:
    logits = torch.randn(256, 152064, device="cuda") * 4
    seeds, steps = torch.arange(256, device="cuda"), torch.arange(256, device="cuda") * 3
    out = sample_triton(logits, seeds, steps)
    ref = sample_ref(logits, seeds, steps)
    assert (out == ref).float().mean() > 0.99  # fast-math log may flip a near-tie
