"""Mixture-of-experts and MLA architectures against transformers on tiny random checkpoints
(fp32, CPU): prompt logits, 16 greedy tokens (recomputed and through the paged cache), the
engine's batched paged decode, and expert-parallel tensor parallelism."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.services.engine.layers.mla import MLAAttention
from flotilla.services.engine.llm import LLM
from flotilla.services.engine.loader import load_model
from flotilla.services.engine.sampling_params import SamplingParams
from tests.engine.conftest import SingleSequenceRunner, rel_error, tensor_parallel_logits

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
           num_key_value_heads=4, moe_intermediate_size=32, intermediate_size=96,
           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1, num_hidden_layers=3)

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_key_value_heads=2,
                                      num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    # V2-Lite shape (no q_lora_rank), grouped softmax routing, YaRN with mscale.
    "deepseek_v2": ("DeepseekV2Config", dict(
        MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=2.0, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 64})),
    # V3 shape: q_lora_rank, sigmoid + correction bias + grouped top-k, routed scaling.
    "deepseek_v3": ("DeepseekV3Config", dict(
        MLA, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    "deepseek_v3_neox_rope": ("DeepseekV3Config", dict(
        MLA, q_lora_rank=24, n_group=2, topk_group=1, rope_interleave=False)),
}


def save_tiny(path: Path, arch: str, seed: int = 0, **extra: Any) -> torch.nn.Module:
    import transformers

    config_name, overrides = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**COMMON, **overrides, **extra})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a zero correction bias would not show whether it is applied
        for module in hf.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.1)
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # a random model must not stop early
    return hf.eval()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:  # a transformers model
    # An explicit all-ones mask: given only pad_token_id, generate() infers the mask from
    # input_ids != pad_token_id and hides every token 0 of a random prompt.
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_hf_greedy_reference_attends_to_token_zero(tmp_path: Path) -> None:
    """The reference itself: a prompt holding token 0 (= pad_token_id) is attended in full, as
    by plain forwards. Without the mask, prompt 1 of the H200 MLA test (token 0 at position 20)
    gave transformers 47, 112, ... against the engine's (correct) 153, 110, ..."""
    hf = save_tiny(tmp_path, "deepseek_v3")
    gen = torch.Generator().manual_seed(7)
    prompt = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 40)][1]
    assert prompt[20] == 0
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(3):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert hf_greedy(hf, prompt, 3) == seq[len(prompt):]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prompt_logits_and_greedy_match_transformers(tmp_path: Path, arch: str) -> None:
    hf = save_tiny(tmp_path, arch)
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    runner = SingleSequenceRunner(model, max_tokens=64)
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()

    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt])).logits[0]
    err = rel_error(runner.forward(prompt), ref_logits)
    assert err < 1e-4, f"{arch}: prompt logits rel. error {err:.2e}"

    expected = hf_greedy(hf, prompt, 16)
    assert runner.greedy_recompute(prompt, 16) == expected
    assert runner.greedy_cached(prompt, 16) == expected


def test_mla_chunked_prefill_matches_full_prefill(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill chunks over a cached prefix, and query rows split into small score blocks."""
    save_tiny(tmp_path, "deepseek_v2")
    model, _ = load_model(tmp_path)
    prompt = list(range(3, 40))
    full = SingleSequenceRunner(model).forward(prompt)
    monkeypatch.setattr("flotilla.services.engine.layers.mla.SCORES_BYTES",
                        4 * 4 * 40 * 3)  # 3 rows
    chunked = SingleSequenceRunner(model)
    parts = [chunked.forward(prompt[:17]), chunked.forward(prompt[17:30], start=17),
             chunked.forward(prompt[30:], start=30)]
    assert rel_error(torch.cat(parts), full) < 1e-5


def test_mla_cache_holds_only_the_latent(tmp_path: Path) -> None:
    save_tiny(tmp_path, "deepseek_v3")
    model, _ = load_model(tmp_path)
    layers = model.attention_layers()
    assert len(layers) == 3
    # kv_lora_rank 32 + qk_rope_head_dim 16 per token, one "head", no V cache
    assert {layer.kv_cache_shape() for layer in layers} == {((1, 48), (0,))}


def test_engine_batched_decode_matches_transformers(tmp_path: Path) -> None:
    """Several sequences through the engine: paged MLA prefill, then batched absorbed decode
    over ragged block tables, against transformers one prompt at a time."""
    hf = save_tiny(tmp_path, "deepseek_v3")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=48, block_size=4,
              quantization=None)
    assert llm.engine.runner.kv_bytes_per_block() == 3 * 48 * 4 * 4  # layers * entry * block
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 13, 22)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [hf_greedy(hf, p, 10) for p in prompts]


def test_engine_mla_triton_kernels_match_transformers(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The path CUDA takes: absorbed Triton MLA kernels (under the interpreter on CPU) for the
    prompts' prefill and the batched split-KV decode, against transformers."""
    monkeypatch.setattr(MLAAttention, "use_kernel", lambda self, t: True)
    hf = save_tiny(tmp_path, "deepseek_v2")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=48, block_size=4,
              quantization=None)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 11, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_mla_kernels_match_transformers(tmp_path: Path) -> None:
    """DeepSeek-V3 (tiny, fp32) on CUDA: Triton MLA prefill and decode, CUDA graphs, against
    transformers on the CPU. Failed on an H200 (2026-11-22; prompt 2 of 3 from its first
    token) because of the reference, not the kernels: prompt 2 holds token 0, which hf_greedy
    then masked as padding (see test_hf_greedy_reference_attends_to_token_zero)."""
    from flotilla.kernels.selection import KernelSelection

    triton_mla = KernelSelection(mla_kernel="triton")
    hf = save_tiny(tmp_path, "deepseek_v3")
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=64, block_size=16,
              quantization=None,
              kernel_selection=triton_mla)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_tensor_parallel_two_ranks_match_single_rank(tmp_path: Path, arch: str) -> None:
    # Experts split 2 + 2 (qwen2_moe) / 4 + 4 (deepseek); MLA heads, shared experts, vocab split.
    save_tiny(tmp_path / "ckpt", arch)
    prompt = list(range(7, 30))
    single = SingleSequenceRunner(load_model(tmp_path / "ckpt").model).forward(prompt)
    assert rel_error(tensor_parallel_logits(tmp_path / "ckpt", prompt), single) < 1e-5
