"""prompt_logprobs: the log-probability of every prompt token after the first and its top-k
alternatives, returned once with the first output; against transformers' log_softmax on a tiny
random llama (fp32), with chunked prefill (several chunks per prompt, mixed with decodes), with
prefix caching (a cached prompt is computed again), with async scheduling; and against the
engine's own `prompt_logits` path on the default model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.services.engine.engine import Engine, EngineConfig, RequestOutput
from flotilla.services.engine.sampling_params import SamplingParams
from tests.engine.conftest import BASE, save_tiny_llama

K = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny-llama-prompt-logprobs")
    return path, save_tiny_llama(path, seed=3)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist()


def _reference(hf: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def _check(entries: list[Any], prompt: list[int], ref: torch.Tensor, k: int = K) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e = entries[i]
        assert e.token_id == prompt[i]
        assert e.logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        top_lps, top_ids = ref[i - 1].topk(k)
        assert [t for t, _ in e.top] == top_ids.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(top_lps.tolist(), abs=1e-4)


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]
         ) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_match_transformers_across_chunks(tiny: Any,
                                                          async_scheduling: bool) -> None:
    path, hf = tiny
    # 8-token steps: a 37-token prompt takes 5+ chunks, sharing steps with another's decodes
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, block_size=4,
                                 max_num_batched_tokens=16, prefill_chunk_size=8,
                                 async_scheduling=async_scheduling))
    long, short = _prompt(37, 1), _prompt(5, 2)
    outs = _run(engine, {
        "busy": (_prompt(6, 3), SamplingParams(temperature=0.0, max_tokens=12)),
        "long": (long, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=K)),
        "short": (short, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K)),
    })
    for rid, prompt in (("long", long), ("short", short)):
        first, *rest = [o for o in outs[rid] if o.new_token_ids]
        assert first.prompt_logprobs is not None and all(o.prompt_logprobs is None for o in rest)
        _check(first.prompt_logprobs, prompt, _reference(hf, prompt))
    assert all(o.prompt_logprobs is None for o in outs["busy"])


def test_a_cached_prompt_is_computed_again_for_its_prompt_logprobs(tiny: Any) -> None:
    path, hf = tiny
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, block_size=4))
    prompt = _prompt(30, 4)
    first = _run(engine, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=1))})
    second = _run(engine, {
        "b": (prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)),
        "c": (prompt, SamplingParams(temperature=0.0, max_tokens=1))})
    assert first["a"][-1].num_cached_tokens == 0 and second["c"][-1].num_cached_tokens == 28
    out = second["b"][-1]
    assert out.num_cached_tokens == 0 and out.prompt_logprobs is not None
    _check(out.prompt_logprobs, prompt, _reference(hf, prompt), k=0)


def test_default_model_prompt_logprobs_equal_its_prompt_logits() -> None:
    engine = Engine(EngineConfig(model="default", device="cpu", kvcache_mem_mib=64,
                                 max_num_batched_tokens=64))
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
              411] * 6  # 96 tokens: two 64-token steps
    ref = engine.prompt_logits(prompt).log_softmax(-1)
    outs = _run(engine, {"r": (prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                      prompt_logprobs=5))})
    entries = outs["r"][-1].prompt_logprobs
    assert entries is not None
    _check(entries, prompt, ref, k=5)
