"""Async scheduling (step N+1 scheduled before step N's tokens reach the host) changes when
outputs arrive, never what they are: compared token for token with the synchronous engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flotilla.services.engine.engine import Engine, EngineConfig, RequestOutput
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import PLACEHOLDER_TOKEN

VOCAB = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, eos_token_id=1, initializer_range=0.1)
    path = tmp_path_factory.mktemp("tiny-async")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def engine(path: Path, async_scheduling: bool, **kw: object) -> Engine:
    kw.setdefault("num_kv_blocks", 64)
    return Engine(EngineConfig(model=str(path), device="cpu", block_size=4,
                               async_scheduling=async_scheduling, **kw))  # type: ignore[arg-type]


def workload(n: int, seed: int) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Staggered arrivals with mixed lengths, stop ids (early stops), penalties and seeds."""
    g = torch.Generator().manual_seed(seed)
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for i in range(n):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(3, 30, (1,), generator=g)),),
                               generator=g).tolist()
        kind = i % 4
        params = SamplingParams(
            temperature=0.0 if kind < 2 else 0.9, seed=i if kind >= 2 else None,
            max_tokens=int(torch.randint(1, 14, (1,), generator=g)), ignore_eos=True,
            stop_token_ids=list(range(2, 12)) if kind == 1 else [],
            repetition_penalty=1.3 if kind == 3 else 1.0)
        arrivals.setdefault(int(torch.randint(0, 12, (1,), generator=g)), []).append(
            (f"r{i}", prompt, params))
    return arrivals


def run(eng: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]
        ) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    step = 0
    while eng.has_unfinished() or any(s >= step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt, params)
        for o in eng.step():
            assert PLACEHOLDER_TOKEN not in o.new_token_ids
            outs.setdefault(o.request_id, []).append(o)
        step += 1
    return outs


def summary(outs: dict[str, list[RequestOutput]]) -> dict[str, tuple]:
    return {rid: ([t for o in os for t in o.new_token_ids], os[-1].finish_reason,
                  [o.num_output_tokens for o in os]) for rid, os in outs.items()}


@pytest.mark.parametrize("kw", [{}, {"num_kv_blocks": 12}, {"prefill_chunk_size": 8},
                                {"max_num_seqs": 3}])
def test_async_outputs_equal_sync_outputs(tiny: Path, kw: dict) -> None:
    arrivals = workload(12, seed=3)
    sync = summary(run(engine(tiny, False, **kw), arrivals))
    eng = engine(tiny, True, **kw)
    assert summary(run(eng, arrivals)) == sync
    stats = eng.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0
    if kw.get("num_kv_blocks") == 12:
        assert stats["preemptions"] > 0


def test_next_step_is_scheduled_before_tokens_arrive(tiny: Path) -> None:
    eng = engine(tiny, True)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    assert eng.step() == []  # the prefill is launched; its token is still on the device
    request = eng.scheduler.requests["a"]
    assert request.token_ids[-1] == PLACEHOLDER_TOKEN
    outs = eng.step()  # launches the decode (input: the placeholder), then collects the prefill
    assert [o.new_token_ids for o in outs] == [[request.token_ids[3]]]
    assert request.token_ids[3] != PLACEHOLDER_TOKEN and request.token_ids[-1] == PLACEHOLDER_TOKEN
    eng.step()
    outs = eng.step()  # the last token: nothing more was scheduled for it (max_tokens)
    assert outs[-1].finished and outs[-1].num_output_tokens == 3
    assert eng.stats()["steps"] == 3 and not eng.has_unfinished()


def test_abort_while_in_flight_drops_the_token(tiny: Path) -> None:
    eng = engine(tiny, True)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8))
    eng.step()
    eng.step()
    assert eng.abort("a")
    outs = eng.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert outs[0].num_output_tokens == 1  # the token collected before the abort
    assert eng.stats()["kv_blocks_used"] == 0 and not eng.has_unfinished()


def test_prompt_logits_between_async_steps(tiny: Path) -> None:
    eng = engine(tiny, True)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
    eng.step()
    logits = eng.prompt_logits([9, 10, 11])
    assert logits.shape == (3, VOCAB)
    outs = [o for _ in range(6) for o in eng.step()]
    ref = run(engine(tiny, False), {0: [("a", [5, 6, 7], SamplingParams(temperature=0.0,
                                                                          max_tokens=4))]})
    assert [t for o in outs for t in o.new_token_ids] == [
        t for o in ref["a"] for t in o.new_token_ids]
