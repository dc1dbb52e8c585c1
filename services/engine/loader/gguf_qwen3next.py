"""GGUF files of the hybrid linear-attention families (llama.cpp archs `qwen3next`, `qwen35`,
`qwen35moe`): their config and the undoing of the converter's tensor transforms.

Rules:
- Config: the Gated DeltaNet sizes come from the `ssm.*` keys (group_count = key heads,
  time_step_rank = value heads, state_size = key head size, inner_size = value heads x value
  head size, conv_kernel); which layers are linear attention from `attention.recurrent_layers`;
  the rotary share from `rope.dimension_count`; MoE keys as for the other MoE archs, top-k
  weights renormalised (both families' routers do).
- Tensors (`fix_tensor`), back to the HF checkpoint's values: the converter stores the (1 + w)
  norm scales as 1 + w (the model's GemmaRMSNorm loader adds the 1 itself), `ssm_a` as
  -exp(A_log), and for qwen35 / qwen35moe reorders the value heads from grouped by key head
  (transformers' order) to tiled (`_reorder_v_heads`): in the v rows of `attn_qkv`, the rows of
  `attn_gate`, `ssm_alpha`, `ssm_beta`, the v channels of `ssm_conv1d`, `ssm_dt`, `ssm_a` and the
  columns of `ssm_out`; the inverse permutation is applied here. The linear-attention tensors
  are therefore always dequantized (a column permutation cannot be applied to quantized blocks);
  the attention, MLP and expert tensors may stay quantized.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flotilla.services.engine.model_config import ModelConfig

HYBRID_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe"})
_ARCHITECTURES = {"qwen3next": "Qwen3NextForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                  "qwen35moe": "Qwen3_5MoeForCausalLM"}
_V_REORDERED = frozenset({"qwen35", "qwen35moe"})
# norms the converter stores as 1 + w (the DeltaNet's gated norm scales by w: left alone)
_ONE_PLUS_W = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
               "q_norm.weight", "k_norm.weight")


def hybrid_config(config: ModelConfig, meta: dict[str, Any], names: set[str]) -> ModelConfig:
    arch = str(meta["general.architecture"])

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    value_heads = int(get("ssm.time_step_rank"))
    recurrent = get("attention.recurrent_layers")
    if recurrent is None:
        interval = int(get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(config.num_layers)]
    hf = {**config.hf_config,
          "linear_num_key_heads": int(get("ssm.group_count")),
          "linear_num_value_heads": value_heads,
          "linear_key_head_dim": int(get("ssm.state_size")),
          "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
          "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
          "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    layer_types = ["linear_attention" if r else "full_attention"
                   for r in list(recurrent)[: config.num_layers]]
    return dataclasses.replace(config, architecture=_ARCHITECTURES[arch],
                               layer_types=layer_types, hf_config=hf)


def keeps_float(hf_name: str) -> bool:
    """Tensors loaded as floats whatever their GGUF type (see the module rules)."""
    return ".linear_attn." in hf_name


def fix_tensor(arch: str, hf_name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """The HF checkpoint's tensor for a converted (dequantized) GGUF tensor."""
    if hf_name.endswith(_ONE_PLUS_W):
        return array - 1.0
    if hf_name.endswith(".A_log"):
        array = np.log(-array)
    if arch not in _V_REORDERED or ".linear_attn." not in hf_name:
        return array
    cfg = config.hf_config
    hk, hv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    if hk == hv:
        return array

    def grouped(a: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
        """Inverse of the converter's reorder along `axis`: tiled [r, Hk, D] -> [Hk, r, D]."""
        a = np.moveaxis(a, axis, 0)
        shape = a.shape
        a = a.reshape(hv // hk, hk, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
        return np.ascontiguousarray(np.moveaxis(a, 0, axis))

    qk = 2 * hk * dk
    if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([array[:qk], grouped(array[qk:], 0, dv)], axis=0)
    if hf_name.endswith("in_proj_z.weight"):
        return grouped(array, 0, dv)
    if hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
        return grouped(array, 0, 1)
    if hf_name.endswith("out_proj.weight"):
        return grouped(array, 1, dv)
    return array
