"""Gemma 2 / Gemma 3 GGUFs (llama.cpp archs "gemma2", "gemma3"): what llama.cpp's converter
changes and what its runtime hard-codes, undone or reproduced here.

Rules (llama.cpp's conversion/gemma.py and src/models/gemma2.cpp, gemma3.cpp):
- The converter stores every `*norm.weight` as 1 + w (ggml's RMSNorm multiplies by the weight;
  Gemma's computes x * (1 + w)); the loader subtracts the 1 again (`NORM_PLUS_ONE`), so the
  model's GemmaRMSNorm gets the checkpoint's w. Gemma 3's per-head q/k norms included.
- Norm names: post_attention_norm -> post_attention_layernorm, ffn_norm ->
  pre_feedforward_layernorm, post_ffw_norm -> post_feedforward_layernorm (gguf_names.py).
- Attention scale: llama.cpp ignores query_pre_attn_scalar and uses 1 / sqrt(head_dim), except
  for the 27B models (found by their layer count: 46 for Gemma 2, 62 for Gemma 3), which use
  1 / sqrt(hidden / heads); the config gets the matching query_pre_attn_scalar.
- Sliding layers: `attention.sliding_window_pattern` (a per-layer bool array, or a period), else
  every 2nd (Gemma 2) / 6th (Gemma 3) layer global (layers i with (i + 1) % period == 0);
  Gemma 2's window defaults to 4096, Gemma 3 without a window has no sliding layers.
- Rope: the sliding layers use `rope.freq_base_swa` (default: Gemma 2 the global base, Gemma 3
  10000, llama.cpp's default) and no scaling on Gemma 3 (its linear factor is the global
  layers'); Gemma 2's sliding layers share the global rope.
- The MLP's activation is GELU-tanh; embeddings are scaled by sqrt(hidden) in the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flotilla.services.engine.model_config import ModelConfig

NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})
_PERIOD = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_ARCHITECTURE = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_DEFAULT_SWA_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa


def _layer_types(pattern: Any, num_layers: int, period: int) -> list[str]:
    if isinstance(pattern, list | tuple):
        return ["sliding_attention" if bool(p) else "full_attention" for p in pattern]
    period = int(pattern) if pattern else period
    return ["sliding_attention" if (i + 1) % period else "full_attention"
            for i in range(num_layers)]


def gemma_config(config: ModelConfig, meta: dict[str, Any], names: set[str]) -> ModelConfig:
    arch = str(meta["general.architecture"])

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    window = get("attention.sliding_window", 4096 if arch == "gemma2" else None)
    window = int(window) if window else None
    layer_types = None
    if window is not None:
        layer_types = _layer_types(get("attention.sliding_window_pattern"), config.num_layers,
                                   _PERIOD[arch])
    scalar = (config.hidden_size / config.num_heads if config.num_layers == _LAYERS_27B[arch]
              else config.head_dim)
    swa_theta = get("rope.freq_base_swa")
    sliding_theta: float | None = None
    if arch == "gemma3":
        sliding_theta = float(swa_theta) if swa_theta is not None else _DEFAULT_SWA_THETA
    elif swa_theta is not None:
        sliding_theta = float(swa_theta)
    return dataclasses.replace(
        config, architecture=_ARCHITECTURE[arch], hidden_act="gelu_pytorch_tanh",
        sliding_window=window, layer_types=layer_types, query_pre_attn_scalar=scalar,
        sliding_rope_theta=sliding_theta,
        sliding_rope_scaling=None if arch == "gemma3" else config.rope_scaling)


__all__ = ["NORM_PLUS_ONE", "gemma_config"]
