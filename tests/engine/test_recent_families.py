"""The families of 2026 (SmolLM3, GLM-4.5 MoE, gpt-oss, Llama 4 text, Gemma 4 text dense and
MoE, MiniMax-M2, DeepSeek-V3.2 through its dense fallback) against transformers on tiny random
checkpoints (fp32, CPU).

Each tiny model is built from transformers' own config class (`AutoConfig.for_model`) with
`from_config`, its 1-D parameters (norm scales, biases, attention sinks: constant at init) and
routers' correction biases randomised so they matter, and saved with `save_pretrained`; our
loader reads it back. Checked per family:
- prompt logits against transformers' forward, and the logits of every cached (paged-KV) decode
  step against `generate`'s (rel. error < 1e-4), and 16 greedy tokens equal to `generate`'s;
- a prompt prefilled in three chunks over the paged cache gives the logits of one prefill;
- the Engine, with prefill chunks of 8 tokens, blocks of 4 and a KV pool too small for all
  requests at once (so some are preempted and recomputed), gives every prompt `generate`'s
  greedy tokens.
Sliding-window and chunked-attention cases use windows far shorter than the prompts, so they cut.
gpt-oss also loads from an MXFP4 checkpoint (experts dequantized on the CPU path, or kept MXFP4
and run by the interpreted Triton kernel) against transformers' own dequantization, and the MoE
families run on two tensor-parallel ranks (slow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from flotilla.kernels.selection import KernelSelection
from flotilla.services.engine.loader import load_model
from tests.engine.conftest import SingleSequenceRunner, rel_error, tensor_parallel_logits
from tests.engine.test_architectures import decode_logits

VOCAB = 1000
WINDOW = 8
PROMPT_LEN = 24
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False)


class Family(NamedTuple):
    model_type: str
    overrides: dict[str, Any]


FAMILIES: dict[str, Family] = {
    # NoPE on every 4th layer (the default no_rope_layers), plus an explicit pattern.
    "smollm3": Family("smollm3", {}),
    "smollm3_pattern": Family("smollm3", dict(no_rope_layers=[0, 1, 1, 0])),
    # GLM-4.5: one dense layer, then sigmoid routing with correction bias over 2 groups, a shared
    # expert, q/k norms, q/k/v biases, rotary on a quarter of each head; an MTP layer in the
    # checkpoint (layer 3 of 3) that generation skips.
    "glm4_moe": Family("glm4_moe", dict(
        num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
        partial_rotary_factor=0.25, num_nextn_predict_layers=1)),
    # gpt-oss: sinks, sliding / full layers, its default YaRN (factor 32, untruncated), biased
    # router and experts, the SwiGLU clamp low enough to cut.
    "gpt_oss": Family("gpt_oss", dict(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        swiglu_limit=0.5)),
    # Llama 4: chunks of 8 on the rope layers (L2 q/k norm), a NoPE global layer with
    # temperature tuning that starts at position 3 (floor_scale 4), llama3 rope, MoE every
    # second layer with a shared expert, top-1 routing, input-scaled experts.
    "llama4_text": Family("llama4_text", dict(
        intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=WINDOW,
        floor_scale=4, attn_scale=0.5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
    # Gemma 4 (E2B-like): sliding / full layers, full layers with a wider head, one KV head and
    # values from the key projection, proportional rope, per-layer embeddings, the last two
    # layers reading the KV of layers 2 / 3 with double-wide MLPs, final soft-cap.
    "gemma4_text": Family("gemma4_text", dict(
        num_hidden_layers=6, sliding_window=WINDOW, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, use_double_wide_mlp=True,
        final_logit_softcapping=3.0, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"] * 3)),
    # Gemma 4 MoE (26B-A4B-like): a routed gelu-tanh expert branch beside every layer's MLP
    # (router norm, scale and per-expert scales perturbed), values from keys on full layers.
    "gemma4_moe": Family("gemma4_text", dict(
        num_hidden_layers=4, sliding_window=WINDOW, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        final_logit_softcapping=3.0, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"] * 2)),
    # MiniMax-M2: q/k RMSNorm over all heads, half-rotary (legacy `rotary_dim`), sigmoid top-2
    # of 4 experts with a correction bias, renormalised.
    "minimax_m2": Family("minimax_m2", dict(
        intermediate_size=32, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    # DeepSeek-V3.2 through the dense fallback: its indexer keeps index_topk (64) keys, more
    # than any sequence here holds, so transformers' sparse attention is dense too.
    "deepseek_v32": Family("deepseek_v32", dict(
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=24,
        num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, index_topk=64, index_n_heads=2,
        index_head_dim=32, num_hidden_layers=3)),
}


def save_tiny(path: Path, family: Family, seed: int = 0) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family.model_type, **{**TINY, **family.overrides})
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
            if tensor.dim() == 1 and tensor.is_floating_point() and "inv_freq" not in name:
                tensor.add_(torch.randn_like(tensor) * 0.2)
    hf.save_pretrained(path)
    if getattr(config, "num_nextn_predict_layers", 0):
        _add_mtp_layer(path, config)
    hf.generation_config.eos_token_id = None  # a random model must not stop early
    return hf.eval()


def _add_mtp_layer(path: Path, config: Any) -> None:
    """GLM's multi-token-prediction layer as published checkpoints store it (the layer after
    the last; transformers does not build it)."""
    from safetensors.torch import save_file

    layer, h = f"model.layers.{config.num_hidden_layers}", config.hidden_size
    save_file({f"{layer}.eh_proj.weight": torch.randn(h, 2 * h),
               f"{layer}.enorm.weight": torch.ones(h),
               f"{layer}.self_attn.q_proj.weight": torch.randn(h, h)},
              path / "model-mtp.safetensors")


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prompt(length: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path: Path, name: str) -> None:
    assert_matches_transformers(tmp_path, FAMILIES[name])


def assert_matches_transformers(path: Path, family: Family) -> Any:
    """A tiny random `family` checkpoint written to `path`, loaded in fp32 on CPU: prompt logits,
    16 decode steps' logits and the greedy tokens equal transformers' on the same weights.
    Returns the model."""
    hf = save_tiny(path, family)
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    assert config.architecture == hf.config.architectures[0]
    runner = SingleSequenceRunner(model, max_tokens=64)
    prompt = _prompt()
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt])).logits[0]
    err = rel_error(runner.forward(prompt), ref_logits)
    assert err < 1e-4, f"{family.model_type}: prompt logits rel. error {err:.2e}"

    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                          do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    expected = ref.sequences[0, PROMPT_LEN:].tolist()
    step_err = rel_error(decode_logits(runner, prompt, expected), torch.cat(ref.logits).float())
    assert step_err < 1e-4, f"{family.model_type}: decode-step logits rel. error {step_err:.2e}"
    assert runner.greedy_cached(prompt, 16) == expected
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_chunked_prefill_matches_one_prefill(tmp_path: Path, name: str) -> None:
    save_tiny(tmp_path, FAMILIES[name])
    model, _ = load_model(tmp_path)
    prompt = _prompt(40, seed=3)
    full = SingleSequenceRunner(model).forward(prompt)
    chunked = SingleSequenceRunner(model)
    parts = [chunked.forward(prompt[:17]), chunked.forward(prompt[17:30], start=17),
             chunked.forward(prompt[30:], start=30)]
    assert rel_error(torch.cat(parts), full) < 1e-5


@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_with_chunked_prefill_and_preemption_matches_transformers(
        tmp_path: Path, name: str) -> None:
    from flotilla.services.engine.engine import Engine, EngineConfig
    from flotilla.services.engine.sampling_params import SamplingParams

    hf = save_tiny(tmp_path, FAMILIES[name])
    prompts = [_prompt(n, seed=10 + n) for n in (21, 6, 15)]
    # 10 blocks of 4 tokens: the three sequences (up to 33 tokens each) cannot all stay resident
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32",
                                 block_size=4, num_kv_blocks=10, prefill_chunk_size=8,
                                 max_num_batched_tokens=16, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.stats()["preemptions"] > 0
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, prompt, 12), f"request r{i}"


def save_mxfp4_gpt_oss(path: Path, family: Family = FAMILIES["gpt_oss"]) -> Any:
    """A tiny gpt-oss checkpoint laid out as the published ones in `path / "mxfp4"`: experts as
    MXFP4 `*_blocks` / `*_scales` with a `quantization_config`; in `path / "float"` the same
    weights, the experts dequantized by transformers' own gpt-oss MXFP4 loader function.
    Returns the transformers model of the float one."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from flotilla.kernels.mxfp4_moe import quantize_mxfp4_ref

    save_tiny(path / "float", family)
    state = load_file(path / "float" / "model.safetensors")
    packed: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4_ref(tensor.transpose(1, 2))  # [E, out, in]
            packed[f"{name}_blocks"] = blocks.unflatten(-1, (-1, 16))
            packed[f"{name}_scales"] = scales
            state[name] = convert_moe_packed_tensors(packed[f"{name}_blocks"], scales,
                                                     dtype=torch.float32)
        else:
            packed[name] = tensor
    (path / "mxfp4").mkdir()
    save_file(packed, path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "float" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (path / "mxfp4" / "config.json").write_text(json.dumps(config))
    save_file(state, path / "float" / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(path / "float", dtype=torch.float32,
                                              attn_implementation="eager")
    hf.generation_config.eos_token_id = None
    return hf.eval()


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_gpt_oss_mxfp4_experts_match_transformers(tmp_path: Path, kernels: str) -> None:
    """torch: the CPU engine's path (experts dequantized once at load); triton: the CUDA path
    (experts kept MXFP4 in memory, kernels/mxfp4_moe.py under the interpreter)."""
    hf = save_mxfp4_gpt_oss(tmp_path)
    selection = KernelSelection(quant_kernels=kernels)  # type: ignore[arg-type]
    model, _ = load_model(tmp_path / "mxfp4", dtype=torch.float32, device="cpu",
                          kernel_selection=selection)
    experts = model.model.layers[0].mlp.experts
    kept = getattr(experts.w13, "blocks", None)
    assert (kept is not None and kept.dtype == torch.uint8) == (kernels == "triton")
    runner = SingleSequenceRunner(model, max_tokens=64)
    prompt = _prompt()
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt])).logits[0]
    err = rel_error(runner.forward(prompt), ref_logits)
    assert err < 1e-4, f"MXFP4 gpt-oss ({kernels}): prompt logits rel. error {err:.2e}"
    assert runner.greedy_cached(prompt, 6) == hf_greedy(hf, prompt, 6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_oss", "llama4_text", "glm4_moe"])
def test_tensor_parallel_two_ranks_match_single_rank(tmp_path: Path, name: str) -> None:
    """Heads (and gpt-oss's sinks) split 2 + 2, experts (with their biases, or llama4's
    input-scaled routing) split between the ranks, vocabulary split."""
    save_tiny(tmp_path / "ckpt", FAMILIES[name])
    prompt = _prompt()
    single = SingleSequenceRunner(load_model(tmp_path / "ckpt").model).forward(prompt)
    assert rel_error(tensor_parallel_logits(tmp_path / "ckpt", prompt), single) < 1e-5


def test_dummy_gpt_oss_in_the_mxfp4_layout_runs(tmp_path: Path) -> None:
    """load_format "dummy" (benchmarks) builds the layout config.json's quantization_config
    names (MXFP4 expert blocks) with finite random weights."""
    import json

    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt_oss", **{**TINY, **FAMILIES["gpt_oss"].overrides})
    cfg = {**config.to_dict(), "architectures": ["GptOssForCausalLM"],
           "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(tmp_path, load_format="dummy")
    logits = SingleSequenceRunner(model).forward(_prompt())
    assert bool(torch.isfinite(logits).all()) and float(logits.std()) > 0


def test_gemma4_multimodal_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma4ForConditionalGeneration (text_config, `model.language_model.` names, a vision
    tower to skip) against transformers' text forward of the same model."""
    from transformers import AutoConfig, Gemma4ForConditionalGeneration

    text = {**TINY, **FAMILIES["gemma4_text"].overrides, "model_type": "gemma4_text"}
    config = AutoConfig.for_model("gemma4", text_config=text, audio_config=None, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8))
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    model, loaded = load_model(tmp_path)
    assert loaded.architecture == "Gemma4ForConditionalGeneration"
    prompt = _prompt()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    assert rel_error(SingleSequenceRunner(model).forward(prompt), ref) < 1e-4
