"""DeepSeek-V2 / V3 GGUFs (llama.cpp arch "deepseek2"): metadata -> the HF config the
deepseek_v2 / deepseek_v3 models read, and kv_b_proj rebuilt from llama.cpp's split.

Rules:
- One GGUF arch covers both models. A file is DeepSeek-V3 when its router is sigmoid
  (`expert_gating_func` 2) or it has `exp_probs_b` tensors (V3's e_score_correction_bias, which
  V2 has not); else DeepSeek-V2. llama.cpp's converter writes no gating function when
  config.json names no `scoring_func` (transformers 5 configs), so a V3 without one is read as
  sigmoid, the only scoring HF's DeepseekV3 has.
- MLA sizes: current converters store attention as MQA over the latent (head_count_kv 1,
  key_length = kv_lora_rank + rope, value_length = kv_lora_rank) with the per-head sizes in
  `key_length_mla` / `value_length_mla`; older files have only key_length = nope + rope and
  value_length = v. `rope.dimension_count` is qk_rope_head_dim.
- `head_dim` is qk_rope_head_dim and num_kv_heads = num_heads, as transformers' DeepSeek
  configs have them (MLA layers size themselves from the hf_config keys, not these).
- YaRN: llama.cpp keeps only 0.1 * mscale_all_dim (`yarn_log_multiplier`); `mscale` is taken
  equal to it, as in every published DeepSeek config (their ratio scales cos/sin, so equal
  values mean no scaling there, and mscale_all_dim^2 scales the softmax).
- Routing: `expert_group_count` > 1 means grouped top-k (V2's group_limited_greedy; V3 is
  always grouped); `expert_weights_norm` (written only when true) is norm_topk_prob;
  `expert_weights_scale` is routed_scaling_factor; `leading_dense_block_count` is
  first_k_dense_replace (every later layer is MoE: llama.cpp has no moe_layer_freq).
- Current converters split kv_b_proj [H * (nope + v), r] per head into attn_k_b
  [H, r, nope] (transposed, for llama.cpp's absorbed attention) and attn_v_b [H, v, r];
  `join_kv_b` undoes it. Older files hold attn_kv_b as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flotilla.services.engine.model_config import ModelConfig

SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1 is softmax)


def deepseek2_config(config: ModelConfig, meta: dict[str, Any], has_correction_bias: bool
                     ) -> ModelConfig:
    """`config` as ModelConfig.from_gguf_metadata read it, with the DeepSeek fields set."""

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"deepseek2.{key}", default)

    gating = get("expert_gating_func")
    v3 = gating == SIGMOID_GATING or has_correction_bias
    rope_dim = int(get("rope.dimension_count"))
    if get("attention.key_length_mla") is not None:
        qk_dim, v_dim = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
    else:
        qk_dim, v_dim = int(get("attention.key_length")), int(get("attention.value_length"))
    n_group = int(get("expert_group_count", 1))
    hf: dict[str, Any] = {
        "q_lora_rank": get("attention.q_lora_rank"),
        "kv_lora_rank": int(get("attention.kv_lora_rank")),
        "qk_nope_head_dim": qk_dim - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_dim,
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
    }
    if get("expert_count"):
        hf.update(
            n_routed_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            n_shared_experts=int(get("expert_shared_count", 0)),
            n_group=n_group, topk_group=int(get("expert_group_used_count", n_group)))
    if v3:
        hf["scoring_func"] = "softmax" if gating == 1 else "sigmoid"
    else:
        hf["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
    return dataclasses.replace(
        config, architecture="DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM",
        num_kv_heads=config.num_heads, head_dim=rope_dim, partial_rotary_factor=1.0,
        rope_scaling=_rope_scaling(config.rope_scaling, get), hf_config=hf)


def _rope_scaling(scaling: dict[str, Any] | None, get: Any) -> dict[str, Any] | None:
    if scaling is None or scaling.get("rope_type") != "yarn":
        return scaling
    scaling = dict(scaling)
    if get("rope.scaling.yarn_log_multiplier") is not None:
        mscale = float(get("rope.scaling.yarn_log_multiplier")) / 0.1
        scaling.update(mscale=mscale, mscale_all_dim=mscale)
    for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
        if get(f"rope.scaling.{key}") is not None:
            scaling[hf_key] = float(get(f"rope.scaling.{key}"))
    return scaling


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """kv_b_proj [H * (nope + v), r] from attn_k_b [H, r, nope] and attn_v_b [H, v, r]."""
    joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(joined.reshape(-1, v_b.shape[2]))
