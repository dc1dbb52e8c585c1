"""The sampling options of issue 20 as the sampler and the engine honour them: logit_bias (a
-100 bias never samples its token, +100 forces it), min_tokens (the stop tokens held back),
stop_token_ids, ignore_eos; and the admission checks that refuse what the engine cannot use."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flotilla.libs.common.context import ContextLengthExceeded
from flotilla.libs.common.messages import SamplingOptions
from flotilla.services.engine.admission import (
    QueueLimits,
    check_deadline,
    retry_after_s,
    to_sampling_params,
)
from flotilla.services.engine.request_error import InvalidParameter
from flotilla.services.engine.sampler import Sampler, SamplingBatch
from flotilla.services.engine.sampling_params import SamplingParams
from tests.engine.test_engine import EOS, make_engine, tiny  # noqa: F401 - the fixture

VOCAB = 50


def _sample(params: SamplingParams, logits: torch.Tensor, n: int, outputs: int = 0,
            stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """n draws of one row (temperature from params), `outputs` tokens already generated."""
    gen = torch.Generator().manual_seed(0)
    tokens = [3] + [4] * outputs
    out = []
    for _ in range(n):
        batch = SamplingBatch.build([params], [gen], [tokens], [1], VOCAB, torch.device("cpu"),
                                    [stop_ids])
        out.append(int(Sampler()(logits, batch).token_ids[0]))
    return out


def test_a_minus_100_bias_never_samples_its_token() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 4.0  # the favourite (~52% of the mass) without the bias
    plain = _sample(SamplingParams(temperature=1.0), logits, 200)
    banned = _sample(SamplingParams(temperature=1.0, logit_bias={7: -100.0}), logits, 200)
    assert plain.count(7) > 60 and 7 not in banned
    assert len(set(banned)) > 20  # the rest of the distribution is still sampled


def test_a_plus_100_bias_forces_its_token() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    forced = _sample(SamplingParams(temperature=1.0, logit_bias={13: 100.0}), logits, 200)
    assert forced == [13] * 200
    greedy = _sample(SamplingParams(temperature=0.0, logit_bias={13: 100.0}), logits, 1)
    assert greedy == [13]


def test_bias_goes_before_the_filters_and_leaves_logprobs_raw() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    low = int(logits[0].argmin())
    params = [SamplingParams(temperature=0.5, top_k=1, logit_bias={low: 100.0}, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=0)]
    batch = SamplingBatch.build(params, [None, None], [[1], [1]], [1, 1], VOCAB,
                                torch.device("cpu"))
    out = Sampler()(logits, batch)
    assert int(out.token_ids[0]) == low  # top-k 1 keeps the biased token
    assert int(out.token_ids[1]) == int(logits[1].argmax())  # the other row is untouched
    assert out.logprobs is not None
    assert float(out.logprobs[0]) == pytest.approx(float(logits[0].log_softmax(-1)[low]))


def test_min_tokens_holds_the_stop_tokens_back_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # the stop token is the favourite
    params = SamplingParams(temperature=1.0, min_tokens=3)
    stops = frozenset({2, 5})
    for outputs in range(3):
        assert not {2, 5} & set(_sample(params, logits, 50, outputs, stops)), outputs
    assert _sample(params, logits, 50, 3, stops).count(2) > 45


def test_engine_min_tokens_with_a_forced_eos_generates_exactly_min_tokens(
        tiny: Any) -> None:  # noqa: F811
    """+100 on EOS makes it every step's choice; min_tokens=5 holds it back for 5 tokens."""
    path, _ = tiny
    engine = make_engine(path)
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(
        temperature=0.0, max_tokens=20, min_tokens=5, logit_bias={EOS: 100.0}))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert EOS not in tokens[:5] and tokens[5] == EOS and len(tokens) == 6
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == EOS


def test_engine_stop_token_ids_stop_and_ignore_eos_goes_past_eos(
        tiny: Any) -> None:  # noqa: F811
    path, _ = tiny
    engine = make_engine(path)
    engine.add_request("stop", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=20, stop_token_ids=[33], logit_bias={33: 100.0}))
    engine.add_request("eos", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={EOS: 100.0}))
    outs: dict[str, list[Any]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["stop"][-1].finish_reason == "stop" and outs["stop"][-1].stop_token_id == 33
    assert [t for o in outs["stop"] for t in o.new_token_ids] == [33]
    assert [t for o in outs["eos"] for t in o.new_token_ids] == [EOS] * 6
    assert outs["eos"][-1].finish_reason == "length"


@pytest.mark.parametrize(("field", "value", "param"), [
    ("seed", 2**64, "seed"),
    ("seed", 2**63, "seed"),
    ("seed", -(2**63) - 1, "seed"),
    ("temperature", float("inf"), "temperature"),
    ("temperature", float("nan"), "temperature"),
    ("temperature", -0.5, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_p", float("nan"), "top_p"),
    ("top_k", -2, "top_k"),
    ("min_p", 1.5, "min_p"),
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", float("-inf"), "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", 10**30, "max_tokens"),
    ("logprobs", 21, "logprobs"),
    ("prompt_logprobs", -1, "prompt_logprobs"),
    ("logit_bias", {5: 101.0}, "logit_bias"),
    ("logit_bias", {5: float("nan")}, "logit_bias"),
    ("logit_bias", {-1: 1.0}, "logit_bias"),
    ("logit_bias", {VOCAB: 1.0}, "logit_bias"),
    ("min_tokens", -1, "min_tokens"),
    ("min_tokens", 11, "min_tokens"),
    ("stop_token_ids", [VOCAB], "stop_token_ids"),
    ("stop_token_ids", [-3], "stop_token_ids"),
])
def test_admission_refuses_values_the_engine_cannot_use(field: str, value: Any,
                                                        param: str) -> None:
    opts = SamplingOptions(**{"max_tokens": 10, field: value})
    with pytest.raises((InvalidParameter, ContextLengthExceeded)) as err:
        to_sampling_params(opts, prompt_len=5, max_model_len=100, vocab_size=VOCAB)
    assert err.value.param == param, str(err.value)


def test_admission_accepts_the_edges_of_every_range() -> None:
    opts = SamplingOptions(seed=2**63 - 1, temperature=1e-9, top_k=10**12, top_p=1.0, min_p=1.0,
                           logit_bias={0: -100, VOCAB - 1: 100}, min_tokens=10, max_tokens=10,
                           logprobs=20, prompt_logprobs=0, stop_token_ids=[VOCAB - 1])
    params = to_sampling_params(opts, prompt_len=5, max_model_len=100, vocab_size=VOCAB)
    assert params.is_greedy  # a temperature too small to divide by is greedy
    assert to_sampling_params(SamplingOptions(seed=-(2**63)), 5, 100, VOCAB).seed == -(2**63)
    # ...and none of them raises inside a step
    logits = torch.randn(2, VOCAB)
    batch = SamplingBatch.build([params, SamplingParams(top_k=10**12, seed=2**63 - 1)],
                                [None, torch.Generator().manual_seed(2**63 - 1)],
                                [[1, 2], [1, 2]], [1, 1], VOCAB, torch.device("cpu"), None)
    out = Sampler()(logits, batch)
    assert not out.failed and out.top_logprobs is not None


def test_queue_limits_and_retry_after() -> None:
    limits = QueueLimits(max_waiting_requests=2, max_waiting_tokens=100)
    assert limits.check(0, 0, 10_000, 50.0) is None  # a long prompt alone is admitted
    assert limits.check(1, 50, 50, 50.0) is None
    full = limits.check(2, 60, 10, 50.0)
    assert full is not None and full.status == 503 and full.code == "engine_overloaded"
    assert full.retry_after_s == 1.2  # 60 tokens at 50 tokens/s
    tokens = limits.check(1, 90, 20, 3.0)
    assert tokens is not None and tokens.retry_after_s == 30.0  # clamped
    assert retry_after_s(1, 1000.0) == 1.0 and retry_after_s(10, 0.0) == 30.0


def test_a_deadline_already_past_is_a_504() -> None:
    assert check_deadline(None) is None and check_deadline(200.0, now=100.0) is None
    late = check_deadline(100.0, now=102.5)
    assert late is not None and late.status == 504 and late.code == "deadline_exceeded"
    assert "2.50 s" in late.message
