"""Eager steps at bucketed row counts (services/engine/row_buckets.py): the buckets, the padded
step inputs, the same tokens and logits as unpadded steps, and the start-up GEMM warm-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.services.engine.row_buckets import (
    logits_bucket,
    token_bucket,
    token_buckets,
    warm_up_gemms,
)
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import ScheduledRequest
from flotilla.services.engine.step_inputs import StepInputBuilder
from tests.engine.test_engine import GREEDY, make_engine, prompts, run, tiny, tokens  # noqa: F401


def test_buckets() -> None:
    assert [token_bucket(n, 8192) for n in (1, 16, 17, 256, 257, 384, 385, 8100, 8192)] == [
        16, 16, 32, 256, 384, 384, 512, 8192, 8192]
    assert token_bucket(100, 40) == 100  # a step past the limit keeps its count
    assert token_bucket(30, 40) == 32 and token_bucket(35, 40) == 40  # never past the limit
    b = token_buckets(8192)
    assert len(b) == 16 + 62 and b[:3] == [16, 32, 48] and b[15:18] == [256, 384, 512]
    assert b[-1] == 8192 and all(token_bucket(n, 8192) in b for n in range(1, 8193))
    assert token_buckets(1000)[-2:] == [896, 1000]
    assert [logits_bucket(n, 256) for n in (1, 3, 5, 33, 53, 200, 256)] == [
        1, 4, 8, 48, 64, 224, 256]


def _sr(tokens: list[int], start: int, blocks: list[int], samples: bool) -> ScheduledRequest:
    return ScheduledRequest("r", tokens, start, blocks, len(tokens) > 1, samples,
                            SamplingParams(), None, 1, tokens)


def test_padded_step_inputs() -> None:
    builder = StepInputBuilder(64, 8, 10, 4, torch.device("cpu"), pad=True)
    inputs = builder.build([
        _sr([7], 5, [3, 9], True),  # decode at position 5 -> block 9, offset 1
        _sr([1, 2, 3], 2, [4, 0], True),
        _sr([8, 9], 0, [6], True),
    ])
    assert inputs.num_tokens == 6 and inputs.num_logits == 3
    assert inputs.input_ids.tolist() == [7, 1, 2, 3, 8, 9] + [0] * 10
    assert inputs.positions.tolist() == [5, 2, 3, 4, 0, 1] + [0] * 10
    assert inputs.meta.slot_mapping.tolist() == [37, 18, 19, 0, 24, 25] + [-1] * 10
    assert inputs.meta.query_start_loc_cpu == [0, 1, 4, 6]  # padding belongs to no sequence
    assert inputs.logits_rows.tolist() == [0, 3, 5, 5]  # bucket 4: the last row again
    decode = builder.build([_sr([7], 5, [3, 9], True), _sr([4], 2, [4], True)])
    assert decode.input_ids.tolist() == [7, 4] and decode.logits_rows.tolist() == [0, 1]
    chunk = builder.build([_sr([1, 2, 3], 0, [4], False)])  # a chunk that samples nothing
    assert chunk.input_ids.shape == (16,) and chunk.logits_rows.tolist() == []


def test_padded_steps_give_the_same_tokens_and_logits(tiny) -> None:  # noqa: F811
    """Padding rows must never reach a real row: a burst (several prefills in one step), a
    staggered mix of prefill and decode, chunked prefill and prompt logits, with and without."""
    path, _ = tiny
    ps = prompts(6, seed=7)
    burst = {0: [(f"b{i}", p, GREEDY) for i, p in enumerate(ps[:4])]}
    mixed = {2 * i: [(f"m{i}", p, GREEDY)] for i, p in enumerate(ps)}
    for kw in ({}, {"prefill_chunk_size": 5, "max_num_batched_tokens": 12}):
        plain, padded = make_engine(path, **kw), make_engine(path, pad_eager_steps=True, **kw)
        assert padded.runner.inputs.pad and not plain.runner.inputs.pad
        for arrivals in (burst, mixed):
            assert tokens(run(padded, arrivals)) == tokens(run(plain, arrivals))
        p = ps[0] + ps[1]
        torch.testing.assert_close(padded.prompt_logits(p), plain.prompt_logits(p),
                                   atol=1e-5, rtol=1e-5)
        assert padded.stats()["kv_blocks_used"] == 0


def test_warm_up_runs_every_layer_shape_at_every_bucket(tiny, monkeypatch) -> None:  # noqa: F811
    path: Path = tiny[0]
    engine = make_engine(path)
    model = engine.runner.model
    calls: set[tuple[int, int]] = set()
    from flotilla.services.engine.quant.base import UnquantizedLinearMethod

    real = UnquantizedLinearMethod.apply

    def spy(self, layer, x, bias=None):  # type: ignore[no-untyped-def]
        assert x.is_contiguous()
        calls.add((x.shape[0], x.shape[1]))
        return real(self, layer, x, bias)

    monkeypatch.setattr(UnquantizedLinearMethod, "apply", spy)
    warm_up_gemms(model, 64, [16, 32, 40], [1, 2], torch.float32, torch.device("cpu"))
    # tiny llama: q/k/v and gate/up read 64 columns, o reads 64, down reads 128; the LM head
    # (a QuantMethod of its own class here too) reads 64 at the logits buckets
    assert {(r, w) for r, w in calls if r in (16, 32, 40)} == {
        (r, w) for r in (16, 32, 40) for w in (64, 128)}
    assert {(1, 64), (2, 64)} <= calls


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
