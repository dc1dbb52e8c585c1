"""The engine on a CUDA GPU (Triton kernels, CUDA graphs) against transformers. Run via device.

- tiny random llama, fp32: continuous batching with graphs gives transformers' greedy tokens;
- a random 1B-class llama in bf16 (few layers, real hidden sizes): the first 32 greedy tokens equal
  transformers', or where bf16 ties flip a token, the prompt logits agree within 2e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.services.engine.engine import Engine, EngineConfig
from flotilla.services.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _save(path: Path, dtype: torch.dtype, **cfg: object):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**cfg)).to(dtype)
    hf.save_pretrained(path)
    return hf.cuda().eval()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _run(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [got[f"r{i}"] for i in range(len(prompts))]


def test_tiny_llama_fp32_graphs_match_transformers(tmp_path: Path) -> None:
    hf = _save(tmp_path, torch.float32, vocab_size=512, hidden_size=128, intermediate_size=256,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                 kvcache_mem_mib=64))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (int(n),), generator=g).tolist() for n in (5, 17, 33, 64, 3)]
    got = _run(engine, prompts, 24)
    for p, toks in zip(prompts, got, strict=True):
        assert toks == _hf_greedy(hf, p, 24)


def test_1b_class_bf16_matches_transformers(tmp_path: Path) -> None:
    hf = _save(tmp_path, torch.bfloat16, vocab_size=128256, hidden_size=2048,
               intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               tie_word_embeddings=True, initializer_range=0.02)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                 kvcache_mem_mib=1024))
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 128256, (40,), generator=g).tolist()
    ours = _run(engine, [prompt], 32)[0]
    ref = _hf_greedy(hf, prompt, 32)
    if ours != ref:  # bf16 near-ties may flip a token: then the logits must still agree
        k = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
        seq = prompt + ref[:k + 1]
        with torch.no_grad():
            want = hf(torch.tensor([seq], device="cuda")).logits[0].float().cpu()
        got = engine.prompt_logits(seq)
        err = float((got - want).norm() / want.norm())
        assert err < 2e-2, f"token {k} differs and logits rel. error is {err:.3g}"


def test_async_scheduling_matches_sync_with_graphs(tmp_path: Path) -> None:
    """Async scheduling on the GPU (placeholder tokens fed from the device into graph replays,
    pinned host copies behind events) gives the synchronous engine's tokens, finish reasons and
    counts, through arrivals, early stops and finishes at different steps."""
    _save(tmp_path, torch.float32, vocab_size=512, hidden_size=128, intermediate_size=256,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(3)
    work = []
    for i in range(24):
        prompt = torch.randint(2, 512, (int(torch.randint(2, 90, (1,), generator=g)),),
                               generator=g).tolist()
        params = SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=int(torch.randint(1, 40, (1,), generator=g)),
                                stop_token_ids=list(range(2, 20)) if i % 3 == 0 else [])
        work.append((i // 3, f"r{i}", prompt, params))
    results = []
    for async_scheduling in (False, True):
        engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                     kvcache_mem_mib=64, async_scheduling=async_scheduling))
        outs: dict[str, list] = {}
        step = 0
        while engine.has_unfinished() or step <= work[-1][0]:
            for _, rid, prompt, params in (w for w in work if w[0] == step):
                engine.add_request(rid, prompt, params)
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(
                    (o.new_token_ids, o.finish_reason, o.num_output_tokens))
            step += 1
        results.append(outs)
    assert results[1] == results[0]


def test_long_prompt_dense_attention_matches_paged_and_transformers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1,500-token prompt without a cached prefix attends through torch's fused attention
    (kernels/dense_attention.py); its logits agree with the paged Triton kernel's and with
    transformers' within bf16 tolerance."""
    from flotilla.kernels import dense_attention
    from flotilla.kernels.selection import KernelSelection

    # the dense path on any GPU (auto: Hopper and later); the engine's layers keep it
    dense_on = KernelSelection(dense_prefill="1")
    hf = _save(tmp_path, torch.bfloat16, vocab_size=32000, hidden_size=2048,
               intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0,
               tie_word_embeddings=False, initializer_range=0.02)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                 kvcache_mem_mib=1024, kernel_selection=dense_on))
    prompt = torch.randint(0, 32000, (1500,), generator=torch.Generator().manual_seed(4)).tolist()
    calls: list[int] = []
    real = dense_attention.dense_causal_attention
    monkeypatch.setattr("flotilla.services.engine.layers.attention.dense_causal_attention",
                        lambda *a: calls.append(1) or real(*a))
    engine.reset_prefix_cache()
    dense = engine.prompt_logits(prompt)
    assert len(calls) == 2  # one per layer
    engine.reset_prefix_cache()
    dense_tokens = _run(engine, [prompt], 8)[0]  # decode reads the K/V the dense path wrote
    assert len(calls) == 4
    monkeypatch.setattr(dense_attention, "DENSE_MIN_TOKENS", 10 ** 9)
    engine.reset_prefix_cache()
    paged = engine.prompt_logits(prompt)
    engine.reset_prefix_cache()
    assert _run(engine, [prompt], 8)[0] == dense_tokens
    assert len(calls) == 4
    # the reference loaded from the checkpoint: _save's model was cast to bf16 after init, which
    # rounds its rotary inv_freq buffer (angles off by ~1e-2 rad per 1,000 positions)
    from transformers import AutoModelForCausalLM

    del hf
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        want = ref(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
    assert float((dense - paged).norm() / paged.norm()) < 1e-2
    assert float((dense - want).norm() / want.norm()) < 2e-2
