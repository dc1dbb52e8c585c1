"""Whole-step CUDA graphs of prefill and mixed steps (services/engine/step_graphs.py): what a
replay loads into the graphs' tensors, which steps take a graph, and (on CPU, the same tensors
and bounds-only metadata run eagerly) the same tokens and logits as eager steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.services.engine.config import EngineConfig
from flotilla.services.engine.engine import Engine
from flotilla.services.engine.step_graphs import StepGraphs
from flotilla.services.engine.step_inputs import StepInputBuilder
from tests.engine.test_engine import GREEDY, make_engine, prompts, run, tiny, tokens  # noqa: F401
from tests.engine.test_row_buckets import _sr


def _unused(ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    raise AssertionError("staging only: nothing runs")


def test_load_pads_sequences_and_sampled_rows() -> None:
    graphs = StepGraphs(_unused, [16, 32], 6, 10, 40, torch.device("cpu"))
    assert [graphs.rows_of(t) for t in (16, 32)] == [6, 6]  # never more than max_seqs
    builder = StepInputBuilder(64, 6, 10, 4, torch.device("cpu"), pad=True)
    inputs = builder.build([
        _sr([7], 5, [3, 9], True),  # a decode row at position 5
        _sr([1, 2, 3], 2, [4, 0], True),
        _sr([8, 9], 0, [6], False),  # a chunk that does not sample
    ])
    graphs.block_tables.fill_(99)
    assert graphs.load(inputs.input_ids, inputs) == 16
    assert graphs.input_ids.tolist() == [7, 1, 2, 3, 8, 9] + [0] * 26
    assert graphs.slot_mapping[:16].tolist() == [37, 18, 19, 0, 24, 25] + [-1] * 10
    # three empty sequences after the real ones: no new tokens, nothing cached
    assert graphs.query_start_loc.tolist() == [0, 1, 4, 6, 6, 6, 6]
    assert graphs.seq_lens.tolist() == [6, 5, 2, 0, 0, 0]
    assert graphs.block_tables[:3, :2].tolist() == [[3, 9], [4, 0], [6, 0]]
    assert graphs.sampled_rows.tolist() == [0, 3, 0, 0, 0, 0]
    meta = graphs.meta(16)
    assert meta.bounds_only and meta.max_query_len == 16 and meta.seq_lens_cpu == []
    # a later, smaller step leaves nothing of this one behind in the sequence tensors
    small = builder.build([_sr([5, 6], 0, [1], True)])
    graphs.load(small.input_ids, small)
    assert graphs.query_start_loc.tolist() == [0, 2, 2, 2, 2, 2, 2]
    assert graphs.seq_lens.tolist() == [2, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="no graph"):
        graphs.load(torch.zeros(48, dtype=torch.int64), builder.build([_sr([1] * 40, 0, [1] * 10,
                                                                           True)]))


def _with_static_graphs(engine: Engine, max_tokens: int) -> list[int]:
    """Give a CPU engine step graphs that run eagerly over their own tensors; returns a list
    that grows by the bucket of every step that took one."""
    graphs = engine.runner.new_step_graphs(max_tokens)
    assert graphs is not None
    taken: list[int] = []
    run_static = graphs.run_static

    def replay(input_ids, inputs):  # type: ignore[no-untyped-def]
        taken.append(input_ids.shape[0])
        return run_static(input_ids, inputs)

    graphs.replay = replay  # type: ignore[method-assign]
    engine.runner.step_graphs = graphs
    return taken


def test_graph_steps_give_the_same_tokens_and_logits(tiny) -> None:  # noqa: F811
    """A burst, a staggered mix of prefill and decode and chunked prefill through the graph
    path give the eager path's greedy tokens; steps past the largest bucket stay eager."""
    path, _ = tiny
    ps = prompts(6, seed=11)
    burst = {0: [(f"b{i}", p, GREEDY) for i, p in enumerate(ps[:4])]}
    mixed = {2 * i: [(f"m{i}", p, GREEDY)] for i, p in enumerate(ps)}
    for kw in ({}, {"prefill_chunk_size": 5, "max_num_batched_tokens": 12}):
        plain = make_engine(path, **kw)
        graphed = make_engine(path, pad_eager_steps=True, **kw)
        taken = _with_static_graphs(graphed, 128)
        buckets = graphed.runner.step_graphs.buckets  # type: ignore[union-attr]
        for arrivals in (burst, mixed):
            taken.clear()
            assert tokens(run(graphed, arrivals)) == tokens(run(plain, arrivals))
            assert taken and set(taken) <= set(buckets)  # decode-only steps: not these graphs
        assert graphed.stats()["kv_blocks_used"] == 0
        p = ps[0] + ps[1]
        torch.testing.assert_close(graphed.prompt_logits(p), plain.prompt_logits(p),
                                   atol=1e-5, rtol=1e-5)
    assert [len(p) for p in ps[:4]] == [27, 18, 30, 25]
    small = make_engine(path, pad_eager_steps=True)
    taken = _with_static_graphs(small, 96)
    run(small, burst)  # its one prefill step has 112 rows: eager
    assert taken == []
    run(small, mixed)  # prompt steps of 27-30 + a few decode rows: bucket 32, and one of 16
    assert sorted(set(taken)) == [16, 32]


def test_eager_warm_up_leaves_no_trace(tiny) -> None:  # noqa: F811
    """The start-up eager steps (one per attention tile on CUDA) write K/V only into free
    blocks: a run after them gives the same tokens, prefix caching on."""
    path, _ = tiny
    ps = prompts(4, seed=5)
    arrivals = {0: [(f"b{i}", p, GREEDY) for i, p in enumerate(ps)]}
    plain, warmed = make_engine(path), make_engine(path)
    warmed.runner.warm_up_eager_steps()
    assert warmed.stats()["kv_blocks_used"] == 0
    assert tokens(run(warmed, arrivals)) == tokens(run(plain, arrivals))


def test_settings_reach_the_config() -> None:
    from flotilla.libs.common.settings import EngineSettings
    from flotilla.services.engine.factory import engine_config

    settings = EngineSettings(step_graph_tokens=128)
    assert engine_config(settings, Path("/m")).step_graph_tokens == 128
    assert engine_config(EngineSettings(), Path("/m")).step_graph_tokens is None
    assert EngineConfig(device="cpu").resolved_step_graph_tokens == 0
    cuda = EngineConfig(device="cuda")
    assert cuda.resolved_step_graph_tokens == 512
    assert EngineConfig(device="cuda", step_graph_tokens=64).resolved_step_graph_tokens == 64
    assert EngineConfig(device="cuda", enforce_eager=True).resolved_step_graph_tokens == 0
    assert EngineConfig(device="cuda", pad_eager_steps=False).resolved_step_graph_tokens == 0
    with pytest.raises(ValueError, match="step_graph_tokens"):
        EngineConfig(step_graph_tokens=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_step_graphs_match_eager_steps(tmp_path: Path) -> None:
    """On CUDA: the captured graphs give the eager path's greedy tokens on a random tiny llama
    (fp32, no TF32), through bursts, decode mixes and chunked prefill."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, eos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ps = [torch.randint(2, 512, (int(n),)).tolist() for n in torch.randint(3, 90, (12,))]
    arrivals = {0: [(f"b{i}", p, GREEDY) for i, p in enumerate(ps[:6])]}
    arrivals |= {3 * i + 1: [(f"m{i}", p, GREEDY)] for i, p in enumerate(ps[6:])}
    common = dict(model=str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=256,
                  max_num_seqs=8)
    out: list[dict[str, list[int]]] = []
    for kw in ({"step_graph_tokens": 0}, {"step_graph_tokens": 512},
               {"step_graph_tokens": 512, "prefill_chunk_size": 48,
                "max_num_batched_tokens": 64}):
        engine = Engine(EngineConfig(**common, **kw))  # type: ignore[arg-type]
        graphs = engine.runner.step_graphs
        assert (graphs is None) == (kw["step_graph_tokens"] == 0)
        out.append(tokens(run(engine, arrivals)))
    assert out[0] == out[1] == out[2]
