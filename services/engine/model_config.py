"""Architecture hyper-parameters of a checkpoint, read from a HF config.json or GGUF metadata.

Rules:
- `ModelConfig` is plain data, built once by the loader and exposed as `model.config`; layers and
  models read only these fields (plus `hf_config` for architecture-specific flags).
- Rope parameters are accepted both as top-level `rope_theta`/`rope_scaling` (transformers 4.x)
  and as nested `rope_parameters` (transformers 5.x). `rope_scaling` is None for plain RoPE.
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
    "phi3": "Phi3ForCausalLM",
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
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf_dir(cls, model_dir: Path) -> ModelConfig:
        cfg = json.loads((model_dir / "config.json").read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_hf_dict(cfg, gen)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None
                     ) -> ModelConfig:
        cfg = {**cfg.get("text_config", {}), **cfg}
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        rope_theta, rope_scaling = _rope_from_hf(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = _as_list(cfg.get("eos_token_id")) + _as_list((generation or {}).get("eos_token_id"))
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos)),
            dtype=_torch_dtype(str(dtype_name)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hf_config=cfg,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tie_word_embeddings: bool,
                           rope_freq_factors: list[float] | None = None) -> ModelConfig:
        """`meta` maps GGUF keys to plain values (with `{arch}.vocab_size` filled in by the reader);
        tying and llama-3 rope factors are decided by the tensors present."""
        arch = str(meta["general.architecture"])

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        scaling: dict[str, Any] | None = None
        if get("rope.scaling.type") not in (None, "none"):
            scaling = {"rope_type": str(get("rope.scaling.type")),
                       "factor": float(get("rope.scaling.factor", 1.0))}
        if rope_freq_factors is not None:
            scaling = {"rope_type": "freq_factors", "factors": rope_freq_factors}
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in meta]
        return cls(
            architecture=GGUF_ARCHITECTURES.get(arch, arch),
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos)),
            dtype=torch.float32,
        )


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    scaling["rope_type"] = kind
    if "original_max_position_embeddings" not in scaling and \
            "original_max_position_embeddings" in cfg:
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return theta, scaling


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in config.json")
    return dtype
