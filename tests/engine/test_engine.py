"""Engine end to end on a tiny random llama, against transformers as the reference."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flotilla.libs.common.context import ContextLengthExceeded
from flotilla.services.engine.engine import Engine, EngineConfig, RequestOutput
from flotilla.services.engine.llm import LLM
from flotilla.services.engine.sampling_params import SamplingParams

VOCAB = 256
EOS = 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=EOS, tie_word_embeddings=False, initializer_range=0.1,
    )
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path, model


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(L),), generator=g).tolist()
            for L in torch.randint(3, 40, (n,), generator=g)]


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])  # explicit mask: a token 0 is not padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_engine(path: Path, **kw: object) -> Engine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=str(path), device="cpu", **kw))  # type: ignore[arg-type]


def run(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]
        ) -> dict[str, list[RequestOutput]]:
    """Step until idle, adding requests at the given step numbers; collect outputs per request."""
    outs: dict[str, list[RequestOutput]] = {}
    step = 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
    return outs


def tokens(outs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()}


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def staggered(ps: list[list[int]], params: SamplingParams = GREEDY) -> dict:
    return {2 * i: [(f"r{i}", p, params)] for i, p in enumerate(ps)}


def test_continuous_batching_greedy_matches_transformers(tiny) -> None:
    path, model = tiny
    ps = prompts(5)
    outs = run(make_engine(path), staggered(ps))
    got = tokens(outs)
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(model, p, 10), f"request r{i}"
        assert outs[f"r{i}"][-1].finished and outs[f"r{i}"][-1].finish_reason == "length"


def test_preemption_under_tiny_kv_pool_gives_identical_outputs(tiny) -> None:
    path, _ = tiny
    ps = prompts(6, seed=2)
    arrivals = {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]}
    relaxed = make_engine(path)
    expected = tokens(run(relaxed, arrivals))
    pressured = make_engine(path, num_kv_blocks=12)  # 48 tokens: two requests at most
    got = tokens(run(pressured, arrivals))
    assert pressured.stats()["preemptions"] > 0
    assert got == expected
    assert pressured.stats()["kv_blocks_used"] == 0


def test_chunked_prefill_matches_one_shot_prefill(tiny) -> None:
    path, model = tiny
    ps = prompts(4, seed=3)
    one_shot = tokens(run(make_engine(path, prefill_chunk_size=0, max_num_batched_tokens=128),
                          staggered(ps)))
    chunked = tokens(run(make_engine(path, prefill_chunk_size=5, max_num_batched_tokens=12),
                         staggered(ps)))
    assert chunked == one_shot
    assert chunked["r0"] == hf_greedy(model, ps[0], 10)


def test_prompt_logits_match_transformers_in_chunks(tiny) -> None:
    path, model = tiny
    p = prompts(1, seed=4)[0] + prompts(1, seed=5)[0]
    with torch.no_grad():
        ref = model(torch.tensor([p])).logits[0]
    for budget in (7, 128):
        got = make_engine(path, max_num_batched_tokens=budget).prompt_logits(p)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_prefix_cache_hit_reports_cached_tokens_and_keeps_outputs(tiny) -> None:
    path, model = tiny
    shared = prompts(1, seed=6)[0] + list(range(2, 22))
    engine = make_engine(path)
    first = run(engine, {0: [("a", shared + [5, 6], GREEDY)]})
    second = run(engine, {0: [("b", shared + [7], GREEDY)]})
    assert first["a"][0].num_cached_tokens == 0
    cached = second["b"][0].num_cached_tokens
    assert cached == (len(shared) // 4) * 4 and cached > 0
    assert tokens(second)["b"] == hf_greedy(model, shared + [7], 10)
    assert engine.stats()["prefix_cache_hit_tokens"] == cached


def test_stop_conditions(tiny) -> None:
    path, model = tiny
    p = prompts(1, seed=7)[0]
    ref = hf_greedy(model, p, 10)
    stop_at = ref[3]
    engine = make_engine(path, max_model_len=len(p) + 6)
    outs = run(engine, {0: [
        ("stop", p, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_at])),
        ("len", p, SamplingParams(temperature=0.0, max_tokens=2)),
        ("ctx", p, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)),
    ]})
    got = tokens(outs)
    assert got["stop"] == ref[: ref.index(stop_at) + 1]
    assert outs["stop"][-1].finish_reason == "stop"
    assert outs["stop"][-1].stop_token_id == stop_at
    assert got["len"] == ref[:2] and outs["len"][-1].finish_reason == "length"
    assert len(got["ctx"]) == 6 and outs["ctx"][-1].finish_reason == "length"
    with pytest.raises(ValueError):
        engine.add_request("too-long", list(range(2, 2 + len(p) + 6)), GREEDY)
    with pytest.raises(ContextLengthExceeded) as err:  # more than the room left: refused
        engine.add_request("too-many", p, SamplingParams(max_tokens=7))
    assert err.value.param == "max_tokens" and "at most 6" in str(err.value)


def test_eos_stops_unless_ignored(tiny) -> None:
    path, _ = tiny
    engine = make_engine(path)
    engine.eos_token_ids = frozenset(range(VOCAB))  # every token is an eos
    outs = run(engine, {0: [("a", [5, 6, 7], SamplingParams(temperature=0.0)),
                            ("b", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3,
                                                            ignore_eos=True))]})
    assert len(tokens(outs)["a"]) == 1 and outs["a"][-1].finish_reason == "stop"
    assert len(tokens(outs)["b"]) == 3 and outs["b"][-1].finish_reason == "length"


def test_abort_frees_blocks_and_reports_abort(tiny) -> None:
    path, _ = tiny
    engine = make_engine(path)
    engine.add_request("a", prompts(1)[0], GREEDY)
    engine.add_request("b", prompts(1, seed=9)[0], GREEDY)
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort("a") and not engine.abort("nope")
    used_by_b = len(engine.scheduler.requests["b"].block_ids)
    assert engine.stats()["kv_blocks_used"] == used_by_b
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert engine.stats()["aborted"] == 1


def test_seeded_sampling_is_reproducible_regardless_of_companions(tiny) -> None:
    path, _ = tiny
    p = prompts(1, seed=10)[0]
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = tokens(run(make_engine(path), {0: [("s", p, seeded)]}))["s"]
    others = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    arrivals = {0: [("x", prompts(1, seed=11)[0], others)],
                1: [("s", p, seeded), ("y", prompts(1, seed=12)[0], others)]}
    crowded = tokens(run(make_engine(path, prefill_chunk_size=4), arrivals))["s"]
    assert crowded == alone
    different = tokens(run(make_engine(path), {0: [("s", p, SamplingParams(
        temperature=1.0, seed=43, max_tokens=12, ignore_eos=True))]}))["s"]
    assert different != alone


def test_logprobs_are_returned_per_token(tiny) -> None:
    path, model = tiny
    p = prompts(1, seed=13)[0]
    outs = run(make_engine(path), {0: [("a", p, SamplingParams(temperature=0.0, max_tokens=2,
                                                                logprobs=3))]})
    first = outs["a"][0].logprobs[0]
    with torch.no_grad():
        ref = model(torch.tensor([p])).logits[0, -1].log_softmax(-1)
    assert first.token_id == int(ref.argmax())
    assert first.logprob == pytest.approx(ref.max().item(), abs=1e-4)
    assert [t for t, _ in first.top] == ref.topk(3).indices.tolist()


def test_llm_generate_and_stream(tiny) -> None:
    path, model = tiny
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, block_size=4, quantization=None)
    ps = prompts(3, seed=14)
    results = llm.generate(ps, GREEDY)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 10) for p in ps]
    assert all(r.finish_reason == "length" for r in results)

    async def collect() -> list[list[int]]:
        async def one(p: list[int]) -> list[int]:
            return [t async for out in llm.stream(p, GREEDY) for t in out.new_token_ids]
        return await asyncio.gather(*(one(p) for p in ps))

    assert asyncio.run(collect()) == [r.token_ids for r in results]

    async def leave_early() -> None:
        async with contextlib.aclosing(llm.stream(ps[0], GREEDY)) as stream:
            async for _ in stream:
                break

    asyncio.run(leave_early())
    stats = llm.engine.stats()
    assert stats["aborted"] == 1 and stats["kv_blocks_used"] == 0 and stats["running"] == 0
    assert llm.generate(ps[0], GREEDY)[0].token_ids == results[0].token_ids
    logits = llm.prompt_logits(ps[0])
    assert logits.shape == (len(ps[0]), VOCAB)


def test_step_inputs_flatten_a_mixed_batch() -> None:
    from flotilla.services.engine.scheduler import ScheduledRequest
    from flotilla.services.engine.step_inputs import StepInputBuilder

    def sr(tokens: list[int], start: int, blocks: list[int], samples: bool) -> ScheduledRequest:
        return ScheduledRequest("r", tokens, start, blocks, len(tokens) > 1, samples,
                                SamplingParams(), None, 1, tokens)

    # Token budget 8 but a block table up to 40 columns wide: buffers must cover both.
    builder = StepInputBuilder(8, 4, 40, 4, torch.device("cpu"))
    inputs = builder.build([
        sr([7], 5, [3, 9], True),  # decode at position 5 -> block 9, offset 1
        sr([1, 2, 3], 2, [4, 0], False),  # prefill chunk at positions 2..4 -> not sampled
        sr([8, 9], 0, [6], True),
    ])
    m = inputs.meta
    assert inputs.input_ids.tolist() == [7, 1, 2, 3, 8, 9]
    assert inputs.positions.tolist() == [5, 2, 3, 4, 0, 1]
    assert m.query_start_loc.tolist() == [0, 1, 4, 6] and m.query_start_loc_cpu == [0, 1, 4, 6]
    assert m.seq_lens.tolist() == [6, 5, 2] and m.max_seq_len == 6 and m.max_query_len == 3
    assert m.block_tables.tolist() == [[3, 9], [4, 0], [6, 0]]
    assert m.slot_mapping.tolist() == [37, 18, 19, 0, 24, 25]
    assert inputs.logits_rows.tolist() == [0, 5]
    wide = builder.build([sr([5], 150, list(range(40)), True)])
    assert wide.meta.block_tables.shape == (1, 38) and wide.meta.slot_mapping.tolist() == [150]
