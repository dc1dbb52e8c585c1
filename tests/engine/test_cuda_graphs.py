"""Decode CUDA graphs: which graph a step replays (CPU), and replays equal eager steps (GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flotilla.kernels.paged_attention import default_num_splits
from flotilla.services.engine.cuda_graphs import SHORT_GRAPH_MAX_BATCH, DecodeGraphs
from flotilla.services.engine.engine import Engine, EngineConfig
from flotilla.services.engine.model_runner import ModelRunner
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import ScheduledRequest


def _graphs(max_batch: int, short_context: int, max_model_len: int = 4096) -> DecodeGraphs:
    def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise AssertionError("selection only: nothing runs")

    return DecodeGraphs(forward, max_batch, 8, max_model_len, torch.device("cpu"), short_context)


def test_short_graphs_cover_the_small_buckets_only() -> None:
    graphs = _graphs(64, 512)
    assert SHORT_GRAPH_MAX_BATCH == 16
    assert graphs.buckets == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graphs.short_buckets == [1, 2, 4, 8, 16]
    assert _graphs(10, 512).short_buckets == [1, 2, 4, 8, 10]
    assert _graphs(64, 0).short_buckets == []
    assert _graphs(64, 4096, max_model_len=4096).short_buckets == []  # the long graphs already


@pytest.mark.parametrize("batch,max_seq_len,expected", [
    (1, 1, (1, True)), (1, 512, (1, True)), (1, 513, (1, False)), (3, 200, (4, True)),
    (9, 512, (16, True)), (16, 4096, (16, False)), (17, 10, (32, False)), (64, 1, (64, False)),
])
def test_a_step_replays_the_short_graph_while_every_sequence_fits(
    batch: int, max_seq_len: int, expected: tuple[int, bool]
) -> None:
    assert _graphs(64, 512).graph_for(batch, max_seq_len) == expected
    assert _graphs(64, 0).graph_for(batch, max_seq_len) == (expected[0], False)


def test_short_graph_metadata_bounds_the_sequences_and_cuts_the_splits() -> None:
    graphs = _graphs(64, 512)
    long, short = graphs._meta(1, short=False), graphs._meta(1, short=True)
    assert (long.max_seq_len, short.max_seq_len) == (4096, 512)
    assert long.is_decode_only and short.is_decode_only
    # What the decode kernel makes of the bounds (8 KV heads): batch 1 16 -> 8 splits,
    # 16 rows 4 -> 1 (no reduce kernel).
    assert [default_num_splits(b, 8, 4096) for b in (1, 16)] == [16, 4]
    assert [default_num_splits(b, 8, 512) for b in (1, 16)] == [8, 1]


def test_engine_settings_reach_the_graphs() -> None:
    from flotilla.libs.common.settings import EngineSettings
    from flotilla.services.engine.factory import engine_config

    assert engine_config(EngineSettings(), Path("/m")).decode_short_context == 512
    config = engine_config(EngineSettings(decode_short_context=0), Path("/m"))
    assert config.decode_short_context == 0
    with pytest.raises(ValueError):
        EngineConfig(decode_short_context=-1)


# ---------------------------------------------------------------------------- GPU

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
    "num_key_value_heads": 8, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "float32",
}


def _request(rid: str, tokens: list[int], computed: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid, token_ids=tokens[computed:], num_computed_tokens=computed,
        block_ids=blocks, is_prefill=computed == 0, samples=True,
        sampling_params=SamplingParams(temperature=0.0), generator=None,
        prompt_len=len(tokens), all_token_ids=tokens,
    )


def decode_logits(runner: ModelRunner, seq_lens: list[int], seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill sequences of seq_lens[i] - 1 tokens (eager), then one decode step of a token
    each: (its logits through runner.forward_step as a decode-only step, the same step eager)."""
    g = torch.Generator().manual_seed(seed)
    bs, next_block = runner.block_size, 0
    prompts, blocks = [], []
    for n in seq_lens:
        prompts.append(torch.randint(0, runner.vocab_size, (n,), generator=g).tolist())
        count = -(-n // bs)
        blocks.append(list(range(next_block, next_block + count)))
        next_block += count
    runner.execute([_request(f"p{i}", p[:-1], 0, b)
                    for i, (p, b) in enumerate(zip(prompts, blocks, strict=True))], False)
    step = [_request(f"p{i}", p, len(p) - 1, b)
            for i, (p, b) in enumerate(zip(prompts, blocks, strict=True))]
    graph = runner.forward_step(step, decode_only=True).logits.clone()
    eager = runner.forward_step(step, decode_only=False).logits.clone()
    return graph, eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_short_and_long_graph_replays_match_eager(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    engine = Engine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cuda",
                                 dtype="float32", max_num_seqs=16, kvcache_mem_mib=256,
                                 decode_short_context=256, async_scheduling=False))
    runner = engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.short_buckets == [1, 2, 4, 8, 16]
    assert set(graphs.graphs) == {(b, s) for b in (1, 2, 4, 8, 16) for s in (False, True)}
    g = torch.Generator().manual_seed(0)
    cases = [[40], [256], [257], [700], [10, 256, 77], [10, 257, 77],
             torch.randint(2, 257, (16,), generator=g).tolist(),
             [*torch.randint(2, 257, (15,), generator=g).tolist(), 600]]
    replayed = set()
    for i, seq_lens in enumerate(cases):
        key = graphs.graph_for(len(seq_lens), max(seq_lens))
        assert key[1] == (max(seq_lens) <= 256)
        replayed.add(key)
        graph, eager = decode_logits(runner, seq_lens, i)
        torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)
    assert replayed == {(1, True), (1, False), (4, True), (4, False), (16, True), (16, False)}
