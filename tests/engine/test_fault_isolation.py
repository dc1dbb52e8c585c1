"""One request's failure inside a step is that request's alone: it finishes with an error (and
its KV blocks are freed), every other request of the batch produces exactly the tokens of an
undisturbed run, and the engine keeps serving. Failures are injected into one request of a
running batch: its grammar matcher, its seeded generator, its batched sampling parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.services.engine.engine import Engine, RequestOutput
from flotilla.services.engine.sampling_params import SamplingParams
from tests.engine.test_engine import make_engine, prompts, tiny  # noqa: F401 - the fixture

PARAMS = {  # the healthy requests: greedy, seeded random, filtered seeded random
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
    "top_k": SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12, ignore_eos=True),
}


class FailingMatcher:
    """Stands in for a request's grammar state; its `fill` raises on its `fail_at`-th call, as a
    broken xgrammar matcher would (allowing every token before that)."""

    def __init__(self, fail_at: int) -> None:
        self.calls, self.fail_at = 0, fail_at

    def fill(self, bitmask: torch.Tensor, row: int, output_ids: Any) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("matcher state corrupted")


class ExplodingParams(SamplingParams):
    """Sampling params whose filter flag cannot be read from its `fail_at`-th step on: the
    batched sampling build raises for the whole batch, not in a per-row part."""

    fail_at = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        self.reads = 0

    @property
    def needs_top_k_top_p(self) -> bool:
        self.reads += 1
        if self.reads >= self.fail_at:
            raise OverflowError("Overflow when unpacking long long")
        return False


def _run(engine: Engine, victim: tuple[str, list[int], SamplingParams] | None,
         on_step: Any = None) -> dict[str, list[RequestOutput]]:
    batch = prompts(3, seed=4)
    for (rid, params), prompt in zip(PARAMS.items(), batch, strict=True):
        engine.add_request(rid, prompt, params)
    if victim is not None:
        engine.add_request(*victim)
    outs: dict[str, list[RequestOutput]] = {}
    step = 0
    while engine.has_unfinished():
        if on_step is not None:
            on_step(engine, step)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
    return outs


def _tokens(outs: dict[str, list[RequestOutput]], rid: str) -> list[int]:
    return [t for o in outs[rid] for t in o.new_token_ids]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _undisturbed(path: Path, async_scheduling: bool) -> dict[str, list[int]]:
    outs = _run(make_engine(path, async_scheduling=async_scheduling), None)
    return {rid: _tokens(outs, rid) for rid in PARAMS}


def _check_isolated(engine: Engine, outs: dict[str, list[RequestOutput]],
                    reference: dict[str, list[int]], status: int) -> None:
    for rid in PARAMS:
        assert _tokens(outs, rid) == reference[rid], rid
        assert outs[rid][-1].finish_reason == "length"
    last = outs["victim"][-1]
    assert last.finished and last.finish_reason == "error"
    assert last.error is not None and last.error.status == status
    assert len(_tokens(outs, "victim")) < 12  # it stopped where it failed
    assert engine.kv.pool.num_used_blocks == 0  # its blocks were freed with everyone's
    assert engine.stats()["failed"] == 1
    # and the engine goes on serving
    engine.add_request("after", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert done[0].finish_reason == "length" and done[0].num_output_tokens == 3


def test_a_grammar_matcher_that_raises_fails_only_its_request(
        tiny: Any, async_scheduling: bool) -> None:  # noqa: F811
    path, _ = tiny
    reference = _undisturbed(path, async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params.guided = FailingMatcher(fail_at=3)  # type: ignore[assignment]
    engine = make_engine(path, async_scheduling=async_scheduling)
    outs = _run(engine, ("victim", [9, 8, 7, 6], params))
    _check_isolated(engine, outs, reference, 500)
    assert len(_tokens(outs, "victim")) == 2  # two steps sampled, the third failed


def test_a_seeded_generator_that_breaks_mid_stream_fails_only_its_request(
        tiny: Any, async_scheduling: bool) -> None:  # noqa: F811
    path, _ = tiny
    reference = _undisturbed(path, async_scheduling)
    engine = make_engine(path, async_scheduling=async_scheduling)

    def break_generator(engine: Engine, step: int) -> None:
        if step == 3:  # its generator turns into something torch.rand cannot draw from
            engine.scheduler.requests["victim"].generator = object()  # type: ignore[assignment]

    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    outs = _run(engine, ("victim", [9, 8, 7, 6], params), break_generator)
    _check_isolated(engine, outs, reference, 500)


def test_params_that_break_the_batched_sampler_fail_only_their_request(
        tiny: Any, async_scheduling: bool) -> None:  # noqa: F811
    path, _ = tiny
    reference = _undisturbed(path, async_scheduling)
    engine = make_engine(path, async_scheduling=async_scheduling)
    params = ExplodingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outs = _run(engine, ("victim", [9, 8, 7, 6], params))
    _check_isolated(engine, outs, reference, 400)  # an OverflowError from its own values


def test_a_request_the_engine_cannot_add_is_refused_alone(tiny: Any) -> None:  # noqa: F811
    path, _ = tiny
    engine = make_engine(path)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("x", [1, 2], SamplingParams(logit_bias={10_000: 1.0}))
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request("y", [1] * 120, SamplingParams(min_tokens=10, max_tokens=None))
    assert not engine.has_unfinished()


def test_prompt_logprob_and_logprob_gathering_that_raise_fail_only_their_request(
        tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The host-side gathering of one request's prompt logprobs (while its prompt is computed)
    and of its sampled-token logprobs (on its 3rd token) each fail that request alone."""
    from flotilla.services.engine import prompt_logprobs, step_output

    path, _ = tiny
    reference = _undisturbed(path, False)

    def broken_gather(*args: Any) -> Any:
        raise IndexError("prompt row out of range")

    monkeypatch.setattr(prompt_logprobs, "_gather", broken_gather)
    engine = make_engine(path)
    outs = _run(engine, ("victim", [9, 8, 7, 6], SamplingParams(
        temperature=0.0, max_tokens=12, prompt_logprobs=2)))
    _check_isolated(engine, outs, reference, 500)
    assert _tokens(outs, "victim") == []  # it failed with its prompt

    real = step_output.TokenLogprobs
    calls = []

    def flaky(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("logprob row lost")
        return real(*args)

    monkeypatch.setattr(step_output, "TokenLogprobs", flaky)
    engine = make_engine(path)
    outs = _run(engine, ("victim", [9, 8, 7, 6], SamplingParams(
        temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)))
    _check_isolated(engine, outs, reference, 500)
    assert len(_tokens(outs, "victim")) == 2
