"""The engine with an fp8 KV cache (kv_cache_dtype="fp8", `--fp8-kvcache`) on a tiny random llama.

Reference: transformers with its attention reading K and V fake-quantized by the fp8 rule (per
token and KV head: scale = amax / 448, e4m3 round to nearest even), written here in plain torch.
Each (token, head) row is quantized on its own, so that is exactly what a cache that quantizes
rows as they are written holds: in fp32 the engine's logits and greedy tokens must match it.
Accuracy against the unquantized cache on this model (measured, head_dim 64): prompt logits within
3.1% of their range (asserted: 5%), the first greedy tokens equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.services.engine.engine import Engine, EngineConfig
from flotilla.services.engine.layers.mla import MLAAttention
from flotilla.services.engine.model_runner import _check_fp8_kv_support
from flotilla.services.engine.sampling_params import SamplingParams
from tests.engine.conftest import rel_error, save_tiny_llama

HEAD_DIM, KV_HEADS, LAYERS = 64, 2, 2
CONFIG: dict[str, Any] = dict(
    hidden_size=4 * HEAD_DIM, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS, initializer_range=0.02)


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    amax = x.float().abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    e4m3 = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (e4m3.float() * scale).to(x.dtype)


def _fp8_kv_attention(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, mask: torch.Tensor | None, **kw: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, q, fake_fp8(k), fake_fp8(v), mask, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(checkpoint, transformers model, the same model with fp8-quantized K/V)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-fp8kv")
    hf = save_tiny_llama(path, **CONFIG)
    AttentionInterface.register("flotilla_fp8_kv", _fp8_kv_attention)
    hf_fp8 = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flotilla_fp8_kv")
    return path, hf, hf_fp8.eval()


def engine(path: Path, kv_cache_dtype: str, dtype: str = "float32", **kw: Any) -> Engine:
    kw.setdefault("num_kv_blocks", 64)
    return Engine(EngineConfig(model=str(path), device="cpu", dtype=dtype, block_size=4,
                               quantization=None, kv_cache_dtype=kv_cache_dtype, **kw))


def prompts() -> list[list[int]]:
    return [torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(i)).tolist()
            for i, n in enumerate((5, 17, 33, 40))]


def greedy(e: Engine, ps: list[list[int]], n: int) -> list[list[int]]:
    """Continuous batching: a new request every other step."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    got: dict[str, list[int]] = {}
    step = 0
    while e.has_unfinished() or step < 2 * len(ps):
        if step % 2 == 0 and step // 2 < len(ps):
            e.add_request(f"r{step // 2}", ps[step // 2], params)
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    return [got[f"r{i}"] for i in range(len(ps))]


def test_fp8_kv_prompt_logits_match_transformers_with_fp8_kv(tiny) -> None:
    path, hf, hf_fp8 = tiny
    p = prompts()[3] + prompts()[2]  # 73 tokens over 19 blocks, in chunks of 16
    with torch.no_grad():
        exact = hf(torch.tensor([p])).logits[0]
        want = hf_fp8(torch.tensor([p])).logits[0]
    got = engine(path, "fp8", max_num_batched_tokens=16).prompt_logits(p)
    assert rel_error(got, want) < 1e-4
    assert 1e-3 < rel_error(got, exact) < 0.05  # quantized for real; the fp8 accuracy cost


def test_fp8_kv_greedy_decode_matches_transformers_with_fp8_kv(tiny) -> None:
    path, _, hf_fp8 = tiny
    ps = prompts()
    got = greedy(engine(path, "fp8"), ps, 12)
    for p, toks in zip(ps, got, strict=True):
        with torch.no_grad():
            ids = torch.tensor([p])
            out = hf_fp8.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                  min_new_tokens=12,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        assert toks == out[0, len(p):].tolist()


def test_fp8_kv_greedy_mostly_equals_the_bf16_cache(tiny) -> None:
    """bf16 model: fp8 vs bf16 cache, 4 requests x 24 tokens. Measured: 3 of 4 identical, the
    fourth diverging at token 7 (a near-tie of a random model); asserted: the first 4 tokens
    of every request and 60% of all tokens."""
    path, _, _ = tiny
    ps = prompts()
    ref = greedy(engine(path, "auto", "bfloat16"), ps, 24)
    got = greedy(engine(path, "fp8", "bfloat16"), ps, 24)
    assert all(a[:4] == b[:4] for a, b in zip(got, ref, strict=True))
    same = sum(x == y for a, b in zip(got, ref, strict=True) for x, y in zip(a, b, strict=True))
    assert same >= 0.6 * 24 * len(ps)


def test_fp8_kv_cache_nearly_doubles_the_blocks_of_a_bf16_budget(tiny) -> None:
    path, _, _ = tiny
    bf16 = engine(path, "auto", "bfloat16", num_kv_blocks=None, kvcache_mem_mib=4).runner
    fp8 = engine(path, "fp8", "bfloat16", num_kv_blocks=None, kvcache_mem_mib=4).runner
    # per token and layer: K and V rows of Hk x D bytes, plus an fp32 scale per row
    assert fp8.kv_bytes_per_block() == LAYERS * 4 * (2 * KV_HEADS * HEAD_DIM + 2 * KV_HEADS * 4)
    assert bf16.kv_bytes_per_block() == LAYERS * 4 * (2 * KV_HEADS * HEAD_DIM * 2)
    assert fp8.num_blocks == (4 << 20) // fp8.kv_bytes_per_block()
    ratio = fp8.num_blocks / bf16.num_blocks
    assert ratio == pytest.approx(4 * HEAD_DIM / (2 * HEAD_DIM + 8), rel=1e-3)  # 1.88 at D=64
    layer = fp8.attention[0]
    assert layer.k_cache.dtype == torch.float8_e4m3fn and layer.kv_scales is not None
    assert layer.kv_scales.k.shape == (fp8.num_blocks, 4, KV_HEADS)


def test_fp8_kv_cache_is_refused_for_mla() -> None:
    mla = MLAAttention(num_heads=2, nope_dim=8, rope_dim=4, v_dim=8, kv_lora_rank=16, scale=0.1)
    with pytest.raises(ValueError, match="MLAAttention"):
        _check_fp8_kv_support([mla])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_kv_gpu_engine_real_heads(tmp_path: Path) -> None:
    """CUDA (Triton kernels, CUDA graphs), bf16, Llama-3-8B heads (GQA 32/8, head_dim 128), 2
    layers: fp8 vs bf16 cache on one memory budget -> 264 vs 512 bytes per token and head pair
    (1.94x the blocks); prompt logits (1000 tokens) within 12% of the bf16 cache's, and closer
    than that to the torch reference path (CPU, bf16) with the same fp8 cache (on CPU, bf16 vs
    fp32 with fp8 caches differ by 0.063: codes flip); greedy decoding over 7-3000 token
    prompts runs through the fp8 decode kernel and CUDA graphs. Greedy tokens are not compared
    with the bf16 cache's: at this random model's ~10% fp8 logits error, near-ties flip (an
    H100 run differed within the first 4 tokens).
    The fp8 error itself is the format's, not the kernels': this random model's fp8-vs-bf16
    logits error is 0.096 through the torch reference on CPU (0.099 in fp32) and measured 0.098
    through the kernels on an H200."""
    save_tiny_llama(tmp_path, vocab_size=1024, hidden_size=4096, intermediate_size=1024,
                    num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=2,
                    max_position_embeddings=4096, initializer_range=0.02)
    ps = [torch.randint(2, 1024, (n,), generator=torch.Generator().manual_seed(n)).tolist()
          for n in (7, 100, 1000, 3000)]
    runs = {}
    for kv in ("auto", "fp8"):
        e = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                kvcache_mem_mib=256, kv_cache_dtype=kv))
        runs[kv] = (e.runner.num_blocks, e.prompt_logits(ps[2]), greedy(e, ps, 16))
        del e
        torch.cuda.empty_cache()
    (n16, l16, t16), (n8, l8, t8) = runs["auto"], runs["fp8"]
    assert n8 / n16 == pytest.approx(512 / 264, rel=1e-2)
    assert rel_error(l8, l16) < 0.12
    ref = Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="bfloat16",
                              quantization=None, kvcache_mem_mib=256, kv_cache_dtype="fp8"))
    assert rel_error(l8, ref.prompt_logits(ps[2])) < 0.08  # not run on a GPU yet
    assert [len(t) for t in t8] == [len(t) for t in t16] == [16] * len(ps)
