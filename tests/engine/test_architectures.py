"""Every dense architecture against transformers on a tiny random checkpoint (fp32, CPU).

For each case a tiny model is built with transformers' own config class and `from_config`, its
1-D parameters (norm scales, biases: zero or one at init) are randomised so they matter, and it is
saved with `save_pretrained`. Our loader reads it back; prompt logits must match transformers'
forward (rel. error < 1e-4), so must the logits of each cached decode step against `generate`'s,
and 16 greedy tokens must equal `generate`'s, both with one prefill plus cached decode steps and
with the whole sequence recomputed each step. Sliding-window cases
use prompts longer than the window, so the window really cuts.

Also: a few architectures batched through the Engine against per-sequence `generate`, and the
legacy / sparse config.json forms on the Hub parsed the way transformers' config classes read them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from flotilla.services.engine.loader import load_model
from tests.engine.conftest import SingleSequenceRunner, rel_error

VOCAB = 256
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.1, pad_token_id=0)
WINDOW = 8
PROMPT_LEN = 24


class Case(NamedTuple):
    model_type: str
    overrides: dict[str, Any]
    hf_class: str = "AutoModelForCausalLM"  # transformers class that builds the model


def _phi3_longrope(original_max: int) -> dict[str, Any]:
    """head_dim 16, half of it rotating: 4 frequencies. Phi3Config copies the top-level
    original_max_position_embeddings into rope_parameters, so it is set at both places."""
    return dict(original_max_position_embeddings=original_max, sliding_window=WINDOW,
                rope_parameters={
                    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                    "original_max_position_embeddings": original_max,
                    "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 2.5, 3.0, 3.5]})


def _yarn(**extra: Any) -> dict[str, Any]:
    return {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
            "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0, **extra}


GEMMA: dict[str, Any] = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                             num_hidden_layers=4, tie_word_embeddings=True)
MINISTRAL3_TEXT: dict[str, Any] = dict(
    TINY, model_type="ministral3", head_dim=16,
    rope_parameters=_yarn(mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1))

CASES: dict[str, Case] = {
    "mistral_sliding": Case("mistral", dict(sliding_window=WINDOW)),
    "ministral_layer_types": Case("ministral", dict(
        head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "ministral3_yarn": Case("ministral3", dict(head_dim=16, rope_parameters=_yarn(
        llama_4_scaling_beta=0.3))),
    "mistral3_text_only": Case("mistral3", dict(text_config=MINISTRAL3_TEXT, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=16, head_dim=8)), "Mistral3ForConditionalGeneration"),
    # Short factors (the whole sequence stays within 64 tokens), then long ones (the prompt
    # alone is longer than 16). transformers re-prefills a sequence that crosses the threshold
    # while decoding; a paged engine keeps its cache (rope_scaling.py), so no case crosses.
    "phi3_longrope_short": Case("phi3", _phi3_longrope(64)),
    "phi3_longrope_long": Case("phi3", _phi3_longrope(16)),
    "qwen2_bias": Case("qwen2", {}),
    "qwen2_sliding_layers": Case("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                               max_window_layers=1)),
    "qwen3_qk_norm": Case("qwen3", dict(head_dim=32)),
    "gemma2_softcap": Case("gemma2", dict(GEMMA, attn_logit_softcapping=2.0,
                                          final_logit_softcapping=3.0)),
    "gemma3_text": Case("gemma3_text", dict(GEMMA, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}},
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"])),
    "stablelm_partial_rotary": Case("stablelm", dict(num_key_value_heads=4)),
    "stablelm_qk_norm_parallel": Case("stablelm", dict(use_qkv_bias=True, qk_layernorm=True,
                                                       use_parallel_residual=True)),
    "glm_interleaved": Case("glm", dict(head_dim=16)),
    "glm4_post_norms": Case("glm4", dict(head_dim=16)),
}


def save_tiny(path: Path, case: Case, seed: int = 0) -> Any:
    import transformers
    from transformers import AutoConfig

    base = {} if "text_config" in case.overrides else TINY
    config = AutoConfig.for_model(case.model_type, **{**base, **case.overrides})
    torch.manual_seed(seed)
    model_cls = getattr(transformers, case.hf_class)
    # transformers <= 5.17 runs Gemma 2 through SDPA, which drops the attention soft-cap
    # (later versions refuse SDPA for it): the reference must be eager attention.
    kwargs = ({"attn_implementation": "eager"}
              if getattr(config, "attn_logit_softcapping", None) else {})
    hf = (model_cls.from_config(config, **kwargs) if case.hf_class.startswith("Auto")
          else model_cls(config))
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 1:  # norm scales and biases start constant: make them count
                param.add_(torch.randn_like(param) * 0.2)
    hf.save_pretrained(path)
    return hf.eval()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path: Path, name: str) -> None:
    hf = save_tiny(tmp_path, CASES[name])
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert config.architecture == hf.config.architectures[0]
    if "sliding" in name or name.startswith("gemma"):
        assert config.sliding_window == WINDOW < PROMPT_LEN
    runner = SingleSequenceRunner(model, max_tokens=64)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        ref_logits = hf(prompt[None]).logits[0]
    err = rel_error(runner.forward(prompt.tolist()), ref_logits)
    print(f"{name}: prompt logits rel. error {err:.2e}")
    assert err < 1e-4

    hf.generation_config.eos_token_id = None  # a random model must not stop early
    with torch.no_grad():
        ref = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                          max_new_tokens=16, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    expected = ref.sequences[0, PROMPT_LEN:].tolist()
    step_err = rel_error(decode_logits(runner, prompt.tolist(), expected),
                         torch.cat(ref.logits).float())
    print(f"{name}: decode-step logits rel. error {step_err:.2e}")
    assert step_err < 1e-4
    assert runner.greedy_cached(prompt.tolist(), 16) == expected
    assert runner.greedy_recompute(prompt.tolist(), 16) == expected


def decode_logits(runner: SingleSequenceRunner, prompt: list[int], tokens: list[int]
                  ) -> torch.Tensor:
    """Logits of one prefill and then one cached decode step per token of `tokens`."""
    rows = [runner.forward(prompt, 0, all_logits=False)]
    rows += [runner.forward([tok], len(prompt) + i, all_logits=False)
             for i, tok in enumerate(tokens[:-1])]
    return torch.cat(rows)


# Batches mixing sequences: per-layer windows and ropes, per-sequence LongRoPE choice (one prompt
# below the 32-token threshold, one above), per-head norms, parallel residual.
BATCHED: dict[str, tuple[Case, list[int]]] = {
    "gemma3_text": (CASES["gemma3_text"], [5, 30, 17]),
    "phi3_longrope_mixed": (Case("phi3", _phi3_longrope(32)), [8, 40]),
    "stablelm_qk_norm_parallel": (CASES["stablelm_qk_norm_parallel"], [12, 3, 26]),
    "glm4_post_norms": (CASES["glm4_post_norms"], [20, 9]),
}


@pytest.mark.parametrize("name", list(BATCHED))
def test_engine_batches_match_transformers_per_sequence(tmp_path: Path, name: str) -> None:
    from flotilla.services.engine.engine import Engine, EngineConfig
    from flotilla.services.engine.sampling_params import SamplingParams

    case, lengths = BATCHED[name]
    hf = save_tiny(tmp_path, case)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", num_kv_blocks=64,
                                 block_size=4))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                              min_new_tokens=16,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got[f"r{i}"] == ref[0, len(prompt):].tolist(), f"request r{i}"


# transformers-4 config.json forms still on the Hub, as each architecture's config class reads them.
LEGACY: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(head_dim=16, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        sliding_window=512,
                        sliding_window_pattern=6, num_hidden_layers=8,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "phi3": dict(rms_norm_eps=1e-5, original_max_position_embeddings=4096,
                 max_position_embeddings=131072, partial_rotary_factor=0.75, rope_scaling={
                     "type": "longrope", "short_factor": [1.0] * 6, "long_factor": [4.0] * 6}),
    "qwen2": dict(sliding_window=131072, use_sliding_window=False, max_window_layers=28,
                  rope_theta=1000000.0),
    "stablelm": dict(partial_rotary_factor=0.25, rope_theta=10000.0, layer_norm_eps=1e-5),
    "ministral3": dict(head_dim=16, rms_norm_eps=1e-5,
                       rope_parameters=_yarn(llama_4_scaling_beta=0.1)),
}
FIELDS = ("rotary_dim", "rms_norm_eps", "head_dim", "windows", "ropes")


def _summary(config: Any) -> dict[str, Any]:
    """What the layers read: per-layer sliding window and (theta, schedule) plus sizes."""
    summary = {name: getattr(config, name) for name in FIELDS[:3]}
    summary["windows"] = [config.layer_sliding_window(i) for i in range(config.num_layers)]
    summary["ropes"] = [config.layer_rope(i) for i in range(config.num_layers)]
    return summary


def _schedule(scaling: dict[str, Any] | None, keys: Any) -> dict[str, Any] | None:
    return None if scaling is None else {k: v for k, v in scaling.items()
                                         if k in keys and k not in ("type", "rope_type")}


@pytest.mark.parametrize("model_type", list(LEGACY))
def test_legacy_config_forms_parse_like_transformers_reads_them(model_type: str) -> None:
    """Our parse of a legacy config.json equals our parse of the transformers-5 config that
    transformers' own config class makes of it (rope_parameters, layer_types, ...)."""
    from transformers import AutoConfig

    from flotilla.services.engine.layers.rope_scaling import rope_type
    from flotilla.services.engine.model_config import ModelConfig

    legacy = {**TINY, **LEGACY[model_type], "architectures": ["XForCausalLM"]}
    current = AutoConfig.for_model(model_type, **legacy).to_dict()
    ours = _summary(ModelConfig.from_hf_dict(legacy))
    ref = _summary(ModelConfig.from_hf_dict(current))
    for (theta, mine), (ref_theta, theirs) in zip(ours.pop("ropes"), ref.pop("ropes"),
                                                  strict=True):
        assert theta == ref_theta
        assert rope_type(mine) == rope_type(theirs)
        shared = set(mine or {}) & set(theirs or {})  # bookkeeping keys differ
        assert _schedule(mine, shared) == _schedule(theirs, shared)
    assert ours == ref


def test_gemma2_without_layer_types_alternates_from_a_sliding_first_layer() -> None:
    from transformers import Gemma2Config

    from flotilla.services.engine.model_config import ModelConfig

    cfg = {**TINY, **GEMMA, "architectures": ["Gemma2ForCausalLM"]}
    config = ModelConfig.from_hf_dict(cfg)
    assert config.layer_types is None
    config.default_layer_types(2)
    assert config.layer_types == Gemma2Config(**cfg).layer_types
    assert [config.layer_sliding_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]


def test_sparse_multimodal_config_gets_transformers_defaults() -> None:
    """gemma-3-4b-it's config.json names only the text sizes; the rest are class defaults."""
    from transformers import Gemma3Config

    from flotilla.services.engine.model_config import ModelConfig

    published: dict[str, Any] = {
                 "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "eos_token_id": [1, 106], "text_config": {
                     "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                     "num_hidden_layers": 34, "sliding_window": 1024,
                     "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}
    ours = ModelConfig.from_hf_dict(published)
    ref = ModelConfig.from_hf_dict({**Gemma3Config(**published).to_dict(),
                                    "architectures": published["architectures"]})
    for name in ("vocab_size", "num_heads", "num_kv_heads", "head_dim", "hidden_act",
                 "rms_norm_eps", "tie_word_embeddings", "query_pre_attn_scalar", "eos_token_ids"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert _summary(ours)["windows"] == _summary(ref)["windows"]
    assert [ours.layer_rope(i) for i in (0, 5)] == [ref.layer_rope(i) for i in (0, 5)] == [
        (10000.0, None), (1000000.0, {"rope_type": "linear", "factor": 8.0})]
