"""The CPU decode path (services/engine/cpu_decode.py) against the module forward it replaces:
its in-place attention against the batched reference over shuffled block tables, its logits
against the modules' on tiny int4 / int8 llamas, and the engine's greedy tokens on the default
model with the path on and off (batch 1 and several sequences)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from flotilla import kernels
from flotilla.kernels.attention_metadata import AttentionMetadata
from flotilla.services.engine.cpu_decode import CpuDecode, attend_in_place, block_runs
from flotilla.services.engine.engine import Engine, EngineConfig
from flotilla.services.engine.forward_context import forward_context
from flotilla.services.engine.loader import load_model
from flotilla.services.engine.sampling_params import SamplingParams
from tests.engine.conftest import SingleSequenceRunner, rel_error, save_tiny_llama


def test_block_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([4, 5, 6]) == [(4, 3)]
    assert block_runs([4, 5, 9, 10, 2]) == [(4, 2), (9, 2), (2, 1)]


def _meta(seq_len: int, table: list[int], block_size: int) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.tensor([table], dtype=torch.int32),
        slot_mapping=torch.tensor([0]),
        max_query_len=1,
        max_seq_len=seq_len,
        query_start_loc_cpu=[0, 1],
        seq_lens_cpu=[seq_len],
    )


@pytest.mark.parametrize("order", ["in_order", "shuffled", "one_block"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
def test_attention_in_place_matches_the_reference(order: str, heads: tuple[int, int]) -> None:
    torch.manual_seed(0)
    hq, hk, d, bs, num_blocks = *heads, 32, 16, 24
    k_cache = torch.randn(num_blocks, bs, hk, d)
    v_cache = torch.randn(num_blocks, bs, hk, d)
    seq_len = 1 if order == "one_block" else 150  # 10 blocks, the last one partial
    n = -(-seq_len // bs)
    table = list(range(3, 3 + n))
    if order == "shuffled":
        random.Random(1).shuffle(table)
    q = torch.randn(1, hq, d)
    ref = kernels.paged_attention(q, k_cache, v_cache, _meta(seq_len, table, bs), 0.125)
    runs = block_runs(table)
    assert (len(runs) == 1) == (order != "shuffled")
    ours = attend_in_place(q[0], k_cache, v_cache, runs, seq_len, 0.125)
    assert torch.allclose(ours, ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_decode_logits_match_the_modules(tmp_path: Path, quantization: str) -> None:
    """The torch path (native=False): the modules' ops in the modules' dtypes, equal logits.
    The C++ step (cpu_native.py) is held to its tolerance in tests/engine/test_cpu_native.py."""
    save_tiny_llama(tmp_path, num_hidden_layers=3)
    model = load_model(str(tmp_path), quantization=quantization).model
    fast = CpuDecode.build(model, native=False)
    assert fast is not None and fast.native is None
    runner = SingleSequenceRunner(model, max_tokens=96)
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    runner.forward(prompt)
    token = 17
    with torch.inference_mode():
        for pos in range(len(prompt), len(prompt) + 20):
            ref = runner.forward([token], start=pos)  # writes the slot the fast path rewrites
            meta = runner.metadata(pos, 1)
            with forward_context(meta):
                ours = fast.logits(torch.tensor([token]), torch.tensor([pos]), meta)
            assert rel_error(ours, ref) < 1e-6, pos
            assert int(ours.argmax()) == int(ref.argmax())
            token = int(ref.argmax())


def test_path_declines_what_it_does_not_cover(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    assert CpuDecode.build(load_model(str(tmp_path)).model) is None  # float linears
    save_tiny_llama(tmp_path, attention_bias=True)
    assert CpuDecode.build(load_model(str(tmp_path), quantization="int4").model) is None


def _greedy(engine: Engine, prompts: list[list[int]], tokens: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(
            str(i), prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        )
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_default_model_greedy_tokens_equal_with_the_path_on_and_off() -> None:
    engine = Engine(
        EngineConfig(model="default", device="cpu", kvcache_mem_mib=64, quantization="auto")
    )
    fast = engine.runner.cpu_decode
    assert fast is not None
    prompts = [
        [1, 9690, 198, 2683, 359, 253, 5356, 5646],
        [1, 504, 3458, 282, 4649, 314],
        [1, 19556, 30, 1350],
    ]
    single = _greedy(engine, prompts[:1], 24)
    several = _greedy(engine, prompts, 16)
    engine.runner.cpu_decode = None
    assert _greedy(engine, prompts[:1], 24) == single
    assert _greedy(engine, prompts, 16) == several
