"""Llama-family decoder (Llama 2/3, SmolLM 1-3, TinyLlama, ...) built from the shared layers.

It is also the base the other dense architectures specialise (STYLE rule 8: variants are flags or
subclasses). The hooks, each a class attribute or small method:
- `LlamaAttention.biases(config)` -> (qkv bias, o_proj bias); `qk_norm_cls` (per-head norm of
  q and k before the rotary, e.g. qwen3; `qk_norm(config)` where a config flag decides) and
  `norm_qk`; `rope_is_neox` (False: interleaved pairs,
  GLM); `rotate` (what happens between projection and attention: rotary, plus e.g. ministral3's
  query scaling). Sliding window, softcap, scale, partial rotary and per-layer rope come from
  `ModelConfig` (`layer_sliding_window`, `attn_logit_softcapping`, `attention_scale`,
  `rotary_dim`, `layer_rope`); NoPE layers (`layer_uses_rope` false: smollm3, llama4) run `nope`
  instead of `rotate`; chunked-attention layers come from `layer_attention_chunk`.
- `LlamaDecoderLayer.norm_names`: checkpoint names of the four norm slots (before attention,
  after attention, before the MLP, after the MLP); None leaves a slot out. Llama uses the first
  and third; gemma2/glm4 all four. `norm_cls` picks RMSNorm / GemmaRMSNorm / LayerNorm.
- `LlamaModel.embed` (gemma scales embeddings); `LlamaForCausalLM.model_cls` / `layer_cls`
  (or `decoder_layer_cls(config)` where the config picks the layer, stablelm).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from flotilla.services.engine.distributed import get_tp_size
from flotilla.services.engine.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    gated_projection,
    get_gated_activation,
    get_rope,
)
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.base import CausalLM
from flotilla.services.engine.quant.base import QuantConfig

# Decoder-layer norm slots, in the order they run.
NORM_SLOTS = ("pre_attn", "post_attn", "pre_mlp", "post_mlp")


class LlamaAttention(nn.Module):
    qk_norm_cls: ClassVar[type[nn.Module] | None] = None
    rope_is_neox: ClassVar[bool] = True
    attention_sinks: ClassVar[bool] = False  # a learned sink logit per head (gpt-oss)

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__()
        d = self.head_dim = config.head_dim
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_heads,
                                          config.num_kv_heads, qkv_bias, quant_config,
                                          f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, o_bias,
                                        quant_config, f"{prefix}.o_proj")
        qk_norm_cls = self.qk_norm(config)
        self.has_qk_norm = qk_norm_cls is not None
        if qk_norm_cls is not None:
            self.q_norm = qk_norm_cls(d, config.rms_norm_eps)
            self.k_norm = qk_norm_cls(d, config.rms_norm_eps)
        self.use_rope = config.layer_uses_rope(layer)  # NoPE layers skip it
        theta, scaling = config.layer_rope(layer)
        self.rotary_emb = get_rope(d, config.rotary_dim, config.max_position_embeddings, theta,
                                   scaling, self.rope_is_neox)
        self.attn = Attention(self.num_heads, d, config.attention_scale, self.num_kv_heads,
                              sliding_window=config.layer_sliding_window(layer),
                              logit_softcap=config.attn_logit_softcapping,
                              sinks=self.attention_sinks,
                              attention_chunk=config.layer_attention_chunk(layer))

    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        return config.attention_bias, config.attention_bias

    @classmethod
    def qk_norm(cls, config: ModelConfig) -> type[nn.Module] | None:
        """The per-head q/k norm of this config (None: none); `qk_norm_cls` unless a flag of
        the config decides (glm4_moe's use_qk_norm)."""
        return cls.qk_norm_cls

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> per-head normalised (when the model has q/k norms)."""
        if not self.has_qk_norm:
            return q, k
        d = self.head_dim
        return self.q_norm(q.reshape(-1, d)).view(q.shape), self.k_norm(k.reshape(-1, d)).view(
            k.shape)

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(positions, q, k, self.attn.selection)

    def nope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a NoPE layer does in place of `rotate` (nothing here; llama4 scales q)."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q.reshape(t, self.num_heads, -1), k.reshape(t, self.num_kv_heads, -1))
        if self.fused_rotary:  # one kernel rotates q, k and writes the KV cache
            return self.o_proj(self.attn(q, k, v, self.rotary_emb, positions))
        q, k = self.rotate(positions, q, k) if self.use_rope else self.nope(positions, q, k)
        return self.o_proj(self.attn(q, k, v))

    @property
    def fused_rotary(self) -> bool:
        """The plain rotary with nothing else in `rotate`: Attention may fuse it."""
        plain_rope = type(self.rotary_emb) is RotaryEmbedding
        return self.use_rope and plain_rope and type(self).rotate is LlamaAttention.rotate


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter],
                                                       config.mlp_bias, quant_config,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias,
                                           quant_config, f"{prefix}.down_proj")
        self.act_fn = get_gated_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_projection(self.gate_up_proj, self.act_fn, x))


class LlamaDecoderLayer(nn.Module):
    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    mlp_cls: ClassVar[type[nn.Module]] = LlamaMLP
    norm_cls: ClassVar[type[nn.Module]] = RMSNorm
    norm_names: ClassVar[tuple[str | None, ...]] = (
        "input_layernorm", None, "post_attention_layernorm", None)

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, quant_config, f"{prefix}.self_attn", layer)
        self.mlp = self.mlp_cls(config, quant_config, f"{prefix}.mlp")
        self.norms: dict[str, nn.Module | None] = {}
        for slot, name in zip(NORM_SLOTS, self.norm_names, strict=True):
            norm = None
            if name is not None:
                norm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
                self.add_module(name, norm)
            self.norms[slot] = norm

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, residual stream before it); their sum is the state."""
        pre_attn, post_attn = self.norms["pre_attn"], self.norms["post_attn"]
        pre_mlp, post_mlp = self.norms["pre_mlp"], self.norms["post_mlp"]
        assert pre_attn is not None and pre_mlp is not None
        if residual is None:
            residual, hidden = hidden, pre_attn(hidden)
        else:
            hidden, residual = pre_attn(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if post_attn is not None:
            hidden = post_attn(hidden)
        hidden, residual = pre_mlp(hidden, residual)
        hidden = self.mlp(hidden)
        if post_mlp is not None:
            hidden = post_mlp(hidden)
        return hidden, residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None,
                 layer_cls: type[nn.Module] = LlamaDecoderLayer,
                 norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer_cls(config, quant_config, f"model.layers.{i}", i)
            for i in range(config.num_layers)
        )
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    model_cls: ClassVar[type[LlamaModel]] = LlamaModel
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__(config, quant_config)
        self.tp_size = get_tp_size()
        layer_cls = self.decoder_layer_cls(config)
        self.model = self.model_cls(config, quant_config, layer_cls, layer_cls.norm_cls)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def decoder_layer_cls(cls, config: ModelConfig) -> type[LlamaDecoderLayer]:
        return cls.layer_cls

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
