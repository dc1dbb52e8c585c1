"""Architecture hyper-parameters of a checkpoint, read from a HF config.json or GGUF metadata.

Rules:
- `ModelConfig` is plain data, built once by the loader and exposed as `model.config`; layers and
  models read only these fields (plus `hf_config` for architecture-specific flags).
- Rope parameters are accepted both as top-level `rope_theta`/`rope_scaling` (transformers 4.x)
  and as nested `rope_parameters` (transformers 5.x), also keyed by layer type (gemma3:
  {"full_attention": ..., "sliding_attention": ...}, or legacy `rope_local_base_freq`).
  `rope_scaling` is None for plain RoPE. Multimodal configs are read through `text_config`.
- Sliding windows: `sliding_window` (None when `use_sliding_window` is false) applies to every
  layer unless `layer_types` (or a legacy `sliding_window_pattern`, or qwen2's
  `max_window_layers`) says which layers slide; `layer_sliding_window(i)` answers per layer.
  "chunked_attention" layers (llama4: the rope layers when `layer_types` is absent) attend
  within chunks of `attention_chunk_size` (`layer_attention_chunk(i)`).
- Hybrid linear-attention configs (Qwen3-Next, Qwen3.5) mark their layers "linear_attention" /
  "full_attention" in `layer_types`, or (older Qwen3-Next configs) by `full_attention_interval`.
- NoPE layers (smollm3, llama4): `no_rope_layers[i]` is 1 where layer i applies the rotary and 0
  where it does not (transformers' naming); absent or empty, every `no_rope_layer_interval`-th
  layer skips it when the config names an interval, else every layer rotates.
- `eos_token_ids` is always a list: config.json's eos (int or list) merged with
  generation_config.json's, or GGUF's eos/eot/eom ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# GGUF `general.architecture` -> HF `architectures` name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
# llama.cpp hard-codes the NoPE rhythm of these archs (no GGUF key holds it).
GGUF_NO_ROPE_INTERVAL = {"smollm3": 4, "llama4": 4}
# llama.cpp's routing per MoE arch when the file does not say (`expert_weights_norm`): top-k
# weights renormalised for qwen3moe, not for qwen2moe.
GGUF_MOE_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}


# Defaults of transformers' config classes that published config.json files rely on (the
# text_config of gemma-3-4b-it names only its sizes), by the text model_type.
_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe": dict(partial_rotary_factor=0.5),
    # Qwen3.5-MoE routes like qwen3_moe (top-k weights renormalised) and names no dense width
    "qwen3_5_moe_text": dict(norm_topk_prob=True, intermediate_size=0),
    "gemma4_text": dict(
        vocab_size=262144, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        tie_word_embeddings=True, sliding_window=512, sliding_window_pattern=6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional",
                                            "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}}),
    "llama4_text": dict(no_rope_layer_interval=4, attention_chunk_size=8192,
                        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                        use_qk_norm=True, interleave_moe_layer_step=1),
    "gemma3_text": dict(
        vocab_size=262208, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0),
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    dtype: torch.dtype
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # Rope of "sliding_attention" layers where it differs from the global one (gemma3).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    no_rope_layers: list[int] | None = None
    # "chunked_attention" layers (llama4) see only the keys of their own chunk of this many
    attention_chunk_size: int | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding_layer(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def layer_sliding_window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding_layer(layer) else None

    def layer_attention_chunk(self, layer: int) -> int | None:
        if self.attention_chunk_size is None or self.layer_types is None:
            return None
        return self.attention_chunk_size if self.layer_types[layer] == "chunked_attention" \
            else None

    def layer_uses_rope(self, layer: int) -> bool:
        return self.no_rope_layers is None or bool(self.no_rope_layers[layer])

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of layer `layer`."""
        if self.sliding_rope_theta is not None and self.is_sliding_layer(layer):
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    def default_layer_types(self, pattern: int) -> None:
        """Fill in `layer_types` for configs that leave the alternation implicit: every
        `pattern`-th layer is global, the others slide (gemma2: 2, gemma3: 6)."""
        if self.layer_types is None and self.sliding_window is not None:
            self.layer_types = _pattern_layer_types(self.num_layers, pattern)

    @classmethod
    def from_hf_dir(cls, model_dir: Path) -> ModelConfig:
        cfg = json.loads((model_dir / "config.json").read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_hf_dict(cfg, gen)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None
                     ) -> ModelConfig:
        text = cfg.get("text_config") or {}
        defaults = _CONFIG_DEFAULTS.get(str(text.get("model_type", cfg.get("model_type"))), {})
        cfg = {**defaults, **text, **cfg}
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        rope = _rope_by_layer_type(cfg)
        rope_theta, rope_scaling = rope.get("full_attention") or _rope_from_hf(cfg)
        sliding_rope = rope.get("sliding_attention")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_layers = int(cfg["num_hidden_layers"])
        sliding_window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            sliding_window = None
        eos = _as_list(cfg.get("eos_token_id")) + _as_list((generation or {}).get("eos_token_id"))
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            # LayerNorm models (stablelm) name their epsilon layer_norm_eps.
            rms_norm_eps=float(cfg.get("rms_norm_eps") or cfg.get("layer_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos)),
            dtype=_torch_dtype(str(dtype_name)),
            # Gemma's `hidden_activation` is the one its MLP uses (`hidden_act` is legacy).
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            partial_rotary_factor=_partial_rotary_factor(cfg),
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=_layer_types(cfg, num_layers, sliding_window),
            sliding_rope_theta=sliding_rope[0] if sliding_rope else None,
            sliding_rope_scaling=sliding_rope[1] if sliding_rope else None,
            attn_logit_softcapping=_optional_float(cfg.get("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping")),
            query_pre_attn_scalar=_optional_float(cfg.get("query_pre_attn_scalar")),
            no_rope_layers=_no_rope_layers(cfg, num_layers),
            attention_chunk_size=int(cfg["attention_chunk_size"])
            if cfg.get("attention_chunk_size") else None,
            hf_config=cfg,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tie_word_embeddings: bool,
                           rope_freq_factors: list[float] | None = None,
                           longrope_factors: tuple[list[float], list[float]] | None = None
                           ) -> ModelConfig:
        """`meta` maps GGUF keys to plain values (with `{arch}.vocab_size` filled in by the reader);
        tying, llama-3 rope factors and LongRoPE (long, short) factors are decided by the tensors
        present."""
        arch = str(meta["general.architecture"])

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", hidden // heads))
        context = int(get("context_length", 2048))
        scaling: dict[str, Any] | None = None
        if get("rope.scaling.type") not in (None, "none"):
            scaling = {"rope_type": str(get("rope.scaling.type")),
                       "factor": float(get("rope.scaling.factor", 1.0))}
        if get("rope.scaling.original_context_length") is not None and scaling is not None:
            scaling["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length"))
        if rope_freq_factors is not None:
            scaling = {"rope_type": "freq_factors", "factors": rope_freq_factors}
        if longrope_factors is not None:  # phi3: rope_factors_long / rope_factors_short tensors
            scaling = {"rope_type": "longrope", "long_factor": longrope_factors[0],
                       "short_factor": longrope_factors[1],
                       "original_max_position_embeddings": int(
                           get("rope.scaling.original_context_length", context)),
                       "attention_factor": get("rope.scaling.attn_factor")}
        moe = _gguf_moe_config(arch, get)
        num_layers = int(get("block_count"))
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in meta]
        return cls(
            architecture=("MixtralForCausalLM" if arch == "llama" and moe
                          else GGUF_ARCHITECTURES.get(arch, arch)),
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=context,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos)),
            dtype=torch.float32,
            partial_rotary_factor=int(get("rope.dimension_count", head_dim)) / head_dim,
            sliding_window=int(get("attention.sliding_window", 0)) or None,
            attn_logit_softcapping=_optional_float(get("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(get("final_logit_softcapping")),
            no_rope_layers=_no_rope_layers(
                {"no_rope_layer_interval": GGUF_NO_ROPE_INTERVAL.get(arch)}, num_layers),
            hf_config={**moe, **({} if get("pooling_type") is None
                                 else {"gguf_pooling_type": int(get("pooling_type"))})},
        )


def _gguf_moe_config(arch: str, get: Any) -> dict[str, Any]:
    """The HF config keys the MoE models read (models/moe_base.py: hf_value), from GGUF
    metadata; empty for a dense model."""
    experts = get("expert_count")
    if not experts:
        return {}
    return {"num_local_experts": int(experts), "num_experts": int(experts),
            "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "shared_expert_intermediate_size": get("expert_shared_feed_forward_length"),
            "norm_topk_prob": bool(get("expert_weights_norm",
                                       GGUF_MOE_NORM_TOPK.get(arch, False)))}


_LAYER_TYPES = ("full_attention", "sliding_attention")
# Keys of rope_parameters that are not part of the frequency schedule.
_NOT_SCALING = ("rope_theta", "partial_rotary_factor")


def _rope_from_hf(cfg: dict[str, Any], params: dict[str, Any] | None = None
                  ) -> tuple[float, dict[str, Any] | None]:
    params = dict(cfg.get("rope_parameters") or {}) if params is None else dict(params)
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**legacy, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    # proportional rope (gemma4) turns a share of the head's frequencies: part of its schedule
    dropped = ("rope_theta",) if kind == "proportional" else _NOT_SCALING
    scaling = {k: v for k, v in merged.items() if k not in dropped}
    if kind == "default":
        return theta, None
    scaling["rope_type"] = kind
    if "original_max_position_embeddings" not in scaling and \
            "original_max_position_embeddings" in cfg:
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return theta, scaling


def _rope_by_layer_type(cfg: dict[str, Any]) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """Per-layer-type rope (gemma3), from v5's nested rope_parameters or the legacy
    `rope_local_base_freq`; empty when every layer shares one rope."""
    params = cfg.get("rope_parameters") or {}
    if any(t in params for t in _LAYER_TYPES):
        return {t: _rope_from_hf(cfg, params[t]) for t in _LAYER_TYPES if t in params}
    if "rope_local_base_freq" in cfg:
        return {"full_attention": _rope_from_hf(cfg),
                "sliding_attention": (float(cfg["rope_local_base_freq"]), None)}
    return {}


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    nested = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return float(nested or cfg.get("partial_rotary_factor") or 1.0)


def _pattern_layer_types(num_layers: int, pattern: int) -> list[str]:
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)]


def _layer_types(cfg: dict[str, Any], num_layers: int, sliding_window: Any) -> list[str] | None:
    if cfg.get("layer_types"):
        return [str(t) for t in cfg["layer_types"]]
    if cfg.get("full_attention_interval") and cfg.get("linear_num_value_heads"):
        # hybrid linear attention (Qwen3-Next configs written before layer_types): every
        # interval-th layer is full attention, as transformers' config derives it
        interval = int(cfg["full_attention_interval"])
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(num_layers)]
    if sliding_window and cfg.get("sliding_window_pattern"):  # legacy gemma3 configs
        return _pattern_layer_types(num_layers, int(cfg["sliding_window_pattern"]))
    rope_layers = _no_rope_layers(cfg, num_layers)
    if cfg.get("attention_chunk_size") and rope_layers is not None:
        # llama4 configs written before layer_types: the rope layers attend in chunks
        return ["chunked_attention" if r else "full_attention" for r in rope_layers]
    if sliding_window and cfg.get("use_sliding_window") and "max_window_layers" in cfg:
        first = int(cfg["max_window_layers"])  # qwen2: layers from max_window_layers on slide
        return ["sliding_attention" if i >= first else "full_attention"
                for i in range(num_layers)]
    return None


def _no_rope_layers(cfg: dict[str, Any], num_layers: int) -> list[int] | None:
    if cfg.get("no_rope_layers"):
        return [int(v) for v in cfg["no_rope_layers"]]
    interval = cfg.get("no_rope_layer_interval")
    if not interval:
        return None
    return [int((i + 1) % int(interval) != 0) for i in range(num_layers)]


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in config.json")
    return dtype
