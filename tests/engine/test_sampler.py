"""Sampler: greedy exactness, filters on hand-made logits, seeds independent of the batch."""

import math

import pytest
import torch

from flotilla.services.engine.logits_processors import apply_penalties
from flotilla.services.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    filter_sorted,
)
from flotilla.services.engine.sampling_params import SamplingParams

VOCAB = 6


def batch_for(params: list[SamplingParams], gens=None, tokens=None, prompt_lens=None,
              vocab: int = VOCAB):
    n = len(params)
    return SamplingBatch.build(
        params,
        gens or [None] * n,
        tokens or [[0]] * n,
        prompt_lens or [1] * n,
        vocab,
        torch.device("cpu"),
    )


def kept(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Which tokens survive top-k / top-p / min-p, as the sampler's filtered rows see them."""
    grp = batch_for(params, vocab=logits.shape[1]).filtered
    assert grp is not None and grp.rows is None
    masked, order = filter_sorted(logits, grp)
    full = torch.full_like(logits, float("-inf")).scatter_(1, order, masked)
    return full.isfinite()


def test_params_validation() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_rows_take_exact_argmax_even_beside_random_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1.0)] * 2
    out = Sampler()(logits, batch_for(params))
    assert out.token_ids[:3].tolist() == logits[:3].argmax(-1).tolist()


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, VOCAB)
    out = Sampler()(logits, batch_for([SamplingParams(temperature=1.5, top_k=1)] * 64))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_p_keeps_smallest_nucleus_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)
    params = [SamplingParams(top_p=p) for p in (0.75, 0.85, 0.4)]
    assert kept(logits, params).tolist() == [
        [True, True, False, False],  # 0.5 + 0.3 reaches 0.75
        [True, True, True, False],  # 0.85 needs the third token
        [True, False, False, False],  # the top token alone reaches 0.4
    ]


def test_top_k_masks_all_but_k_largest_per_row() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    params = [SamplingParams(top_k=2), SamplingParams(top_k=4)]
    assert kept(logits, params).tolist() == [[False, True, True, False], [True, True, True, True]]


def test_top_p_applies_within_top_k() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # Renormalised over the top 3 (0.5/0.95 = 0.53, then 0.84): 0.8 needs two tokens.
    assert kept(logits, [SamplingParams(top_k=3, top_p=0.8)]).tolist() == [
        [True, True, False, False]
    ]
    # min-p after top-p: 0.3 < 0.7 * 0.5.
    assert kept(logits, [SamplingParams(top_p=0.75, min_p=0.7)]).tolist() == [
        [True, False, False, False]
    ]


def test_cpu_candidate_shortcut_equals_full_sort() -> None:
    torch.manual_seed(7)
    vocab = 5000
    logits = torch.randn(4, vocab) * 4  # peaked: the nuclei fit in the top 256
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, top_k=100),
              SamplingParams(top_p=0.95, min_p=0.01), SamplingParams(top_k=7)]
    grp = batch_for(params, vocab=vocab).filtered
    masked, order = filter_sorted(logits, grp)
    assert masked.shape[1] == 256  # the shortcut was taken
    flat = torch.randn(1, vocab) * 0.1  # flat: the nucleus does not fit, full sort
    masked_flat, _ = filter_sorted(flat, batch_for([params[0]], vocab=vocab).filtered)
    assert masked_flat.shape[1] == vocab
    # Reference: each row alone through a full sort.
    for i, p in enumerate(params):
        full = torch.full_like(logits[i:i + 1], float("-inf")).scatter_(1, order[i:i + 1],
                                                                        masked[i:i + 1])
        ref_sorted, ref_order = logits[i:i + 1].sort(descending=True)
        probs = ref_sorted.softmax(-1)
        keep = torch.ones_like(probs, dtype=torch.bool)
        if p.top_k:
            keep[:, p.top_k:] = False
        r = probs * keep
        r = r / r.sum()
        keep &= (r.cumsum(-1) - r) < p.top_p
        keep &= r >= p.min_p * r[:, :1]
        ref = torch.zeros_like(keep).scatter_(1, ref_order, keep)
        assert torch.equal(full.isfinite(), ref), f"row {i}"


def test_min_p_masks_below_fraction_of_top_probability() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    mask = apply_min_p(logits, torch.tensor([0.2])).isfinite()
    assert mask.tolist() == [[True, True, True, False]]  # threshold 0.1


def test_filtered_sampling_never_picks_masked_tokens() -> None:
    torch.manual_seed(2)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9]]).log().repeat(2000, 1)
    params = [SamplingParams(top_p=0.75)] * 1000 + [SamplingParams(min_p=0.5)] * 1000
    tokens = Sampler()(logits, batch_for(params)).token_ids
    assert set(tokens.tolist()) == {0, 1}


def test_random_sampling_follows_the_softmax_distribution() -> None:
    torch.manual_seed(3)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    logits = (probs + 1e-12).log().repeat(20000, 1) * 2.0  # temperature 2 undoes the *2
    tokens = Sampler()(logits, batch_for([SamplingParams(temperature=2.0)] * 20000)).token_ids
    freq = torch.bincount(tokens, minlength=VOCAB).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_filtered_sampling_follows_the_renormalised_nucleus() -> None:
    torch.manual_seed(6)
    vocab = 1000  # large enough for the CPU candidate shortcut
    probs = torch.zeros(vocab)
    probs[[10, 500, 999, 3]] = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = (probs + 1e-12).log().repeat(20000, 1)
    tokens = Sampler()(logits, batch_for([SamplingParams(top_p=0.9)] * 20000,
                                         vocab=vocab)).token_ids
    freq = torch.bincount(tokens, minlength=vocab).float() / 20000
    expected = torch.zeros(vocab)
    expected[[10, 500, 999]] = torch.tensor([0.5, 0.3, 0.15]) / 0.95
    assert torch.allclose(freq, expected, atol=0.015)


def test_seeded_rows_are_reproducible_regardless_of_companions() -> None:
    torch.manual_seed(4)
    row = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(position: int, companions: int, steps: int = 8) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        out = []
        for _ in range(steps):
            logits = torch.randn(companions + 1, VOCAB)
            logits[position] = row
            ps = [SamplingParams(temperature=0.7)] * (companions + 1)
            ps[position] = params
            gens = [None] * (companions + 1)
            gens[position] = gen
            out.append(Sampler()(logits, batch_for(ps, gens)).token_ids[position].item())
        return out

    alone = run(0, 0)
    assert run(2, 4) == alone and run(0, 7) == alone
    assert len(set(alone)) > 1  # it does sample


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0, 3.0]])
    p = SamplingParams(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0
    )
    # prompt [0, 1]; generated [3, 3, 5]
    batch = batch_for([p], tokens=[[0, 1, 3, 3, 5]], prompt_lens=[2])
    assert batch.processors is not None and batch.processors.penalties is not None
    out = apply_penalties(logits.clone(), batch.processors.penalties)
    expected = [
        2.0 / 2,  # prompt token: repetition only
        -1.0 * 2,
        0.5,
        1.0 / 2 - 0.25 * 2 - 0.5,
        0.0,
        3.0 / 2 - 0.25 - 0.5,
    ]
    assert out[0].tolist() == pytest.approx(expected)
    assert Sampler()(logits, batch).token_ids.tolist() == [0]  # 1.0 beats 0.75 now


def test_logprobs_come_from_the_raw_distribution() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.5),
              SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.5)]
    out = Sampler()(logits, batch_for(params))
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_token_ids[0].tolist() == ref[0].topk(2).indices.tolist()
    assert math.isclose(out.top_logprobs[0, 0].item(), ref[0].max().item(), rel_tol=1e-6)


def test_greedy_rows_through_the_triton_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path of greedy rows (kernels.argmax -> argmax_triton; on CPU under the Triton
    interpreter) picks torch.argmax's token of the penalised logits: lowest index on ties."""
    import os

    from flotilla import kernels

    cuda = torch.cuda.is_available()
    if not cuda:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs CUDA or the Triton interpreter")
        monkeypatch.setattr(kernels, "use_triton", lambda t, kernels="auto": True)
    device = torch.device("cuda" if cuda else "cpu")
    vocab = 5000  # two chunks of 4096
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=g)
    logits[0, [4500, 100, 4097]] = 7.0  # a tie across chunks: 100
    logits[1] = float("-inf")
    logits[2, [10, 4200]] = 7.0  # the penalty on token 10 leaves 4200
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=2.0),
              SamplingParams(temperature=1.0)]
    batch = SamplingBatch.build(params, [None] * 4, [[1], [1], [10], [1]], [1] * 4, vocab,
                                device)
    out = Sampler()(logits.to(device), batch)
    assert out.token_ids[:3].tolist() == [100, 0, 4200]
