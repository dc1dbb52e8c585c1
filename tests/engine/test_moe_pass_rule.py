"""The MoE pass rule of bench/family_parity.py (bench/moe_pass_rule.py) on synthetic logits.

Logits and routings are built with known per-token errors against a random "truth" (each row's
error is a fixed fraction of that row's norm, so the expected relative errors are exact) and
known flipped tokens, then judged by `compare`, the function the bench uses. A MoE family whose
bf16 flips cost it the plain 2e-2 bar must pass when it routes and computes no worse than
transformers' bf16, and must fail on each of the rule's three conditions alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.family_parity import NEW_TOKENS, Ours, Reference, compare
from bench.moe_pass_rule import TokenSplit, flip_allowance, moe_verdict, split_by_routing

P, V, EXPERTS, TOP_K = 64, 128, 32, 8


def _truth() -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(P + NEW_TOKENS, V, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K]
                       for _ in range(P + NEW_TOKENS)])
    return logits, [ids]


Run = tuple[torch.Tensor, list[torch.Tensor]]  # prompt logits, routing


def _run(truth: torch.Tensor, routing: list[torch.Tensor], flipped: list[int],
         err_routed: float, err_flipped: float, seed: int) -> Run:
    """Prompt logits `err_routed` (rows routed as the truth) / `err_flipped` (rows in `flipped`)
    away from the truth, row by row relative, and the routing with `flipped` tokens' sets
    changed; every routed token's ids are reversed (same set, another order)."""
    gen = torch.Generator().manual_seed(seed)
    rows = truth[:P]
    noise = torch.randn(rows.shape, generator=gen)
    scale = torch.full((P, 1), err_routed)
    scale[flipped] = err_flipped
    logits = rows + noise / noise.norm(dim=1, keepdim=True) * rows.norm(dim=1, keepdim=True) * scale
    ids = routing[0][:P].flip(-1).clone()
    for t in flipped:
        spare = next(e for e in range(EXPERTS) if e not in ids[t].tolist())
        ids[t, 0] = spare
    return logits, [ids]


def _expected(truth: torch.Tensor, flipped: list[int], err_routed: float,
              err_flipped: float) -> float:
    sq = truth[:P].norm(dim=1) ** 2
    frac = torch.full((P,), err_routed ** 2)
    frac[flipped] = err_flipped ** 2
    return math.sqrt(float((sq * frac).sum() / sq.sum()))


HF_FLIPPED = [17, 28, 39, 51, 57]  # DeepSeek-V3 seed 0's transformers bf16 flips (CPU run)


def _compare(our_flipped: list[int], our_routed: float, our_flip: float,
             moe: bool = True) -> dict:
    truth, routing = _truth()
    hf_logits, hf_routing = _run(truth, routing, HF_FLIPPED, 0.015, 0.15, seed=1)
    logits, our_routing = _run(truth, routing, our_flipped, our_routed, our_flip, seed=2)
    tokens = truth[P - 1:P - 1 + NEW_TOKENS].argmax(-1).tolist()
    logprobs = [float(torch.log_softmax(truth[P - 1 + i], -1)[t]) for i, t in enumerate(tokens)]
    ref = Reference(hf_logits, tokens, truth, hf_routing if moe else [],
                    routing if moe else [])
    return compare(ref, Ours(logits, tokens, logprobs, False, our_routing if moe else []))


def test_moe_family_with_fewer_flips_than_transformers_passes_where_plain_rule_fails() -> None:
    truth, _ = _truth()
    ours = [37, 39, 51, 57]
    res = _compare(ours, 0.015, 0.12)
    assert res["err_fp32"] == pytest.approx(_expected(truth, ours, 0.015, 0.12), rel=1e-4)
    assert res["err_fp32"] > 2e-2 and res["hf_bf16_vs_fp32"] > res["err_fp32"]
    assert res["plain"] is False  # reported: the dense rule alone would fail it
    assert res["rule"] == "moe" and res["ok"] is True, res["moe_rule"]
    split = res["routing"]["ours_vs_truth"]
    assert split["tokens"] == 4 and split["flipped"] == ours
    assert split["err_routed"] == pytest.approx(0.015, rel=1e-4)
    assert split["err_flipped"] == pytest.approx(0.12, rel=1e-4)
    assert res["routing"]["hf_bf16_vs_truth"]["tokens"] == len(HF_FLIPPED)
    assert res["routing"]["both_routed_tokens"] == P - len(set(ours) | set(HF_FLIPPED))


def test_dense_family_keeps_the_plain_rule() -> None:
    res = _compare([37, 39, 51, 57], 0.015, 0.12, moe=False)
    assert res["rule"] == "dense" and "routing" not in res
    assert res["ok"] is False and res["plain"] is False


@pytest.mark.parametrize(("flipped", "routed", "flip_err", "failed"), [
    (list(range(8)), 0.015, 0.12, "flips"),  # 8 > 5 + max(2, ceil(1.25)) = 7
    ([37, 39, 51, 57], 0.021, 0.12, "routed"),  # the arithmetic misses 2e-2
    ([37, 39, 51, 57], 0.015, 0.40, "overall"),  # our flips cost far more than transformers'
])
def test_each_moe_condition_fails_alone(flipped: list[int], routed: float, flip_err: float,
                                        failed: str) -> None:
    res = _compare(flipped, routed, flip_err)
    rule = res["moe_rule"]
    assert res["ok"] is False
    assert [k for k in ("routed", "flips", "overall") if not rule[k]] == [failed], rule


def test_flip_count_at_the_allowance_passes() -> None:
    assert _compare(list(range(7)), 0.015, 0.1)["ok"] is True


@pytest.mark.parametrize(("hf", "allowed"), [(0, 2), (4, 6), (8, 10), (9, 12), (12, 15), (20, 25)])
def test_flip_allowance_is_max_of_two_and_a_quarter(hf: int, allowed: int) -> None:
    assert flip_allowance(hf) == allowed


def _split(flips: int, err_routed: float | None) -> TokenSplit:
    return TokenSplit(list(range(flips)), [flips], err_routed, 0.1 if flips else None)


def test_overall_condition() -> None:
    ours, hf = _split(0, 1e-2), _split(0, 1e-2)
    assert moe_verdict(ours, hf, 1.3e-6, 0.0).ok  # --dtype float32: transformers' error is 0
    assert moe_verdict(ours, hf, 1.9e-2, 1.0e-2).ok  # under the dense bar: never stricter
    assert moe_verdict(ours, hf, 2.1e-2, 1.7e-2).ok  # <= 1.25 x transformers'
    assert not moe_verdict(ours, hf, 2.2e-2, 1.7e-2).overall
    assert not moe_verdict(_split(P, None), hf, 1e-2, 1e-2).routed  # no token routed as truth


def test_routed_condition_is_relative_where_the_reference_misses_the_dense_bar() -> None:
    hf = _split(9, 2.57e-2)  # transformers' own routed error above LOGITS_TOL (Qwen3-Next size)
    assert moe_verdict(_split(9, 2.56e-2), hf, 3e-2, 3e-2).routed
    assert moe_verdict(_split(9, 3.2e-2), hf, 3e-2, 3e-2).routed  # <= 1.25 x transformers'
    assert not moe_verdict(_split(9, 3.3e-2), hf, 3e-2, 3e-2).routed
    assert not moe_verdict(_split(9, 2.1e-2), _split(9, 1e-2), 3e-2, 3e-2).routed
    assert not moe_verdict(_split(9, 2.1e-2), _split(9, None), 3e-2, 3e-2).routed


def test_split_counts_expert_sets_not_their_order() -> None:
    truth, routing = _truth()
    shuffled = routing[0][:P].flip(-1)
    logits = truth[:P] * 1.01
    split = split_by_routing(logits, truth[:P], [shuffled], routing)
    assert split.flips == 0 and split.err_flipped is None
    assert split.err_routed == pytest.approx(0.01, rel=1e-5)
