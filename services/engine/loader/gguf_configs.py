"""GGUF metadata -> the HF config keys a model reads, for llama.cpp archs whose metadata says
more than `ModelConfig.from_gguf_metadata` reads generically (deepseek2: gguf_deepseek2.py;
gemma2 / gemma3: gguf_gemma.py).

Rules:
- Each function takes the generic config, the metadata (GGUF key -> value) and the set of tensor
  names, and returns the config with the architecture's fields set; a flag the metadata does not
  hold (a q/k norm, q/k/v biases) is decided by the tensors present.
- glm4moe: `block_count` includes the `nextn_predict_layers` multi-token-prediction layers
  (stored last); the model has the others and skips the MTP tensors. Routing is sigmoid
  (`expert_gating_func` 2) with `exp_probs_b` as the correction bias; `expert_group_count` /
  `expert_group_used_count` are n_group / topk_group; `leading_dense_block_count` is
  first_k_dense_replace; `expert_weights_norm` / `expert_weights_scale` are norm_topk_prob /
  routed_scaling_factor.
- gpt-oss: llama.cpp hard-codes what the metadata leaves out, and so do we: sliding-window
  layers are the even ones (transformers' default layer_types), the SwiGLU's alpha / limit are
  gpt-oss's (1.702 / 7.0), q/k/v/o have biases; YaRN is untruncated (transformers' gpt-oss rope)
  with `rope.scaling.yarn_beta_fast` / `_slow`. The experts' width is
  `expert_feed_forward_length`.
- llama4: likewise hard-coded: NoPE every 4th layer, the rope layers attending in chunks of
  8192 with an L2 q/k norm unless the model has 128 experts (Maverick), temperature tuning on
  the NoPE layers (scale 0.1, floor 8192). `feed_forward_length` is the dense layers' width,
  `expert_feed_forward_length` the experts' and the shared expert's.
- minimax-m2: every layer is MoE, `expert_feed_forward_length` the experts' width; the
  routing (sigmoid, `exp_probs_b` correction bias for the choice, renormalised top-k) and the
  all-heads q/k norms are the model's own (models/minimax_m2.py), the rotary width
  `rope.dimension_count`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flotilla.services.engine.loader.gguf_gemma import gemma_config
from flotilla.services.engine.model_config import ModelConfig


def _getter(meta: dict[str, Any]) -> Callable[..., Any]:
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    return get


def glm4moe_config(config: ModelConfig, meta: dict[str, Any], names: set[str]) -> ModelConfig:
    get = _getter(meta)
    n_group = int(get("expert_group_count", 1))
    hf: dict[str, Any] = {
        "n_routed_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "n_group": n_group,
        "topk_group": int(get("expert_group_used_count", n_group)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
    }
    return dataclasses.replace(
        config, architecture="Glm4MoeForCausalLM",
        num_layers=config.num_layers - int(get("nextn_predict_layers", 0)),
        attention_bias="blk.0.attn_q.bias" in names, hf_config=hf)


def gpt_oss_config(config: ModelConfig, meta: dict[str, Any], names: set[str]) -> ModelConfig:
    get = _getter(meta)
    scaling = dict(config.rope_scaling or {})
    if scaling.get("rope_type") == "yarn":
        scaling["truncate"] = False
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if get(f"rope.scaling.{key}") is not None:
                scaling[hf_key] = float(get(f"rope.scaling.{key}"))
    hf = {"num_local_experts": int(get("expert_count")),
          "num_experts_per_tok": int(get("expert_used_count"))}
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                   for i in range(config.num_layers)]
    return dataclasses.replace(
        config, architecture="GptOssForCausalLM", attention_bias=True,
        intermediate_size=int(get("expert_feed_forward_length")), layer_types=layer_types,
        rope_scaling=scaling or None, hf_config=hf)


def llama4_config(config: ModelConfig, meta: dict[str, Any], names: set[str]) -> ModelConfig:
    get = _getter(meta)
    experts = int(get("expert_count"))
    hf = {"num_local_experts": experts, "num_experts_per_tok": int(get("expert_used_count")),
          "interleave_moe_layer_step": int(get("interleave_moe_layer_step", 1)),
          "intermediate_size_mlp": config.intermediate_size, "use_qk_norm": experts != 128,
          "attn_temperature_tuning": True, "attn_scale": 0.1, "floor_scale": 8192}
    rope = config.no_rope_layers or [1] * config.num_layers
    return dataclasses.replace(
        config, architecture="Llama4ForCausalLM",
        intermediate_size=int(get("expert_feed_forward_length")), attention_chunk_size=8192,
        layer_types=["chunked_attention" if r else "full_attention" for r in rope], hf_config=hf)


def minimax_m2_config(config: ModelConfig, meta: dict[str, Any], names: set[str]
                      ) -> ModelConfig:
    get = _getter(meta)
    hf = {"num_local_experts": int(get("expert_count")),
          "num_experts_per_tok": int(get("expert_used_count"))}
    return dataclasses.replace(
        config, architecture="MiniMaxM2ForCausalLM",
        intermediate_size=int(get("expert_feed_forward_length", config.intermediate_size)),
        hf_config=hf)


# llama.cpp arch -> its config function
GGUF_ARCH_CONFIGS: dict[str, Callable[[ModelConfig, dict[str, Any], set[str]], ModelConfig]] = {
    "glm4moe": glm4moe_config,
    "gpt-oss": gpt_oss_config,
    "llama4": llama4_config,
    "minimax-m2": minimax_m2_config,
    "gemma2": gemma_config,
    "gemma3": gemma_config,
}
