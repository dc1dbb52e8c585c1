"""Gemma 4 text (`Gemma4ForCausalLM`; the language model of `Gemma4ForConditionalGeneration`,
served text-only). Dense checkpoints (E2B / E4B / 31B) and the MoE one (26B-A4B,
`enable_moe_block`: a routed expert branch beside each layer's MLP, models/gemma4_moe.py).

- Layers follow `layer_types` (five sliding per full one by default, the last always full).
  Full layers may have their own head size and KV head count (`per_layer_config`, or the
  published `global_head_dim` / `num_global_key_value_heads`) and, with `attention_k_eq_v`, no
  v_proj: their values are the raw key projection (so k_proj loads into both halves).
- Norms scale the fp32 normalised row and round once (`RMSNormFp32Scale`, transformers'
  Gemma4RMSNorm). Attention: per-head RMSNorm (plain weight) on q and k, a weightless RMSNorm
  on v, scale 1 (the norms set the magnitude); rope in halves, default on sliding layers and
  "proportional" on full ones (rope_scaling.py).
- KV sharing: the last `num_kv_shared_layers` layers have no k / v of their own and attend over
  the cache of the last earlier layer of their type (`SharedKVAttention`, not an `Attention`, so
  the runner gives it no cache).
- Decoder layer: (plain-weight) RMSNorms after attention and around the MLP (GELU-tanh, twice as
  wide on KV-shared layers with `use_double_wide_mlp`), then, with per-layer embeddings (PLE,
  `hidden_size_per_layer_input`), a gated projection of this layer's slice of the per-layer
  input; the layer's output is scaled by its `layer_scalar`.
- Per-layer inputs: `embed_tokens_per_layer` (scaled by sqrt(P)) plus the normed projection of
  the scaled token embedding, times 2^-1/2. Embeddings scaled by sqrt(hidden); final logits
  soft-capped when `final_logit_softcapping` is set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from flotilla import kernels
from flotilla.services.engine.forward_context import get_forward_context
from flotilla.services.engine.layers import (
    Attention,
    ColumnParallelLinear,
    ParallelLMHead,
    ReplicatedLinear,
    RMSNormFp32Scale,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
)
from flotilla.services.engine.layers.moe import expert_weights_mapping
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.base import CausalLM
from flotilla.services.engine.models.gemma4_moe import Gemma4MoE, split_experts
from flotilla.services.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from flotilla.services.engine.models.moe_base import hf_value
from flotilla.services.engine.models.text_only import TextOnlyMixin
from flotilla.services.engine.quant.base import QuantConfig


def layer_dims(config: ModelConfig, layer: int) -> tuple[int, int]:
    """(head_dim, num_kv_heads) of `layer`."""
    per_layer = hf_value(config, "per_layer_config", default=None)
    if per_layer is not None:
        entry: dict[str, Any] = per_layer.get(str(layer)) or per_layer.get(layer) or {}
    elif _layer_type(config, layer) == "full_attention":  # published configs: global sizes
        entry = {"head_dim": hf_value(config, "global_head_dim", default=512)}
        if hf_value(config, "attention_k_eq_v", default=False):
            entry["num_key_value_heads"] = hf_value(config, "num_global_key_value_heads")
    else:
        entry = {}
    return (int(entry.get("head_dim") or config.head_dim),
            int(entry.get("num_key_value_heads") or config.num_kv_heads))


def _layer_type(config: ModelConfig, layer: int) -> str:
    return config.layer_types[layer] if config.layer_types else "full_attention"


def kv_producer(config: ModelConfig, layer: int) -> int | None:
    """The layer whose KV cache `layer` reads (None: it has its own)."""
    first_shared = config.num_layers - int(hf_value(config, "num_kv_shared_layers", default=0))
    if layer < first_shared:
        return None
    kind = _layer_type(config, layer)
    earlier = [i for i in range(first_shared) if _layer_type(config, i) == kind]
    if not earlier:
        raise ValueError(f"KV-shared layer {layer} ({kind}) has no earlier {kind} layer to read")
    return earlier[-1]


def k_eq_v(config: ModelConfig, layer: int) -> bool:
    """Full layers of `attention_k_eq_v` models take their values from the key projection."""
    return bool(hf_value(config, "attention_k_eq_v", default=False)) and \
        _layer_type(config, layer) != "sliding_attention"


def _layer_config(config: ModelConfig, layer: int) -> ModelConfig:
    head_dim, kv_heads = layer_dims(config, layer)
    # query_pre_attn_scalar 1: softmax scale 1 (q and k are RMS-normed per head)
    return dataclasses.replace(config, head_dim=head_dim, num_kv_heads=kv_heads,
                               query_pre_attn_scalar=1.0)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim, in fp32 (transformers' Gemma4RMSNorm)."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


class Gemma4Attention(LlamaAttention):
    qk_norm_cls: ClassVar[type[nn.Module] | None] = RMSNormFp32Scale

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__(_layer_config(config, layer), quant_config, prefix, layer)
        self.eps = config.rms_norm_eps

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q.reshape(t, self.num_heads, -1), k.reshape(t, self.num_kv_heads, -1))
        v = rms(v.reshape(t, self.num_kv_heads, -1), self.eps)
        if self.fused_rotary:
            return self.o_proj(self.attn(q, k, v, self.rotary_emb, positions))
        q, k = self.rotate(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class SharedKVAttention(nn.Module):
    """A KV-shared layer: its own queries (`query_proj`, checkpoint `q_proj`, and `q_norm`) over
    the paged cache of its producer layer's `Attention`, which it never writes."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__()
        cfg = _layer_config(config, layer)
        self.head_dim = d = cfg.head_dim
        self.query_proj = ColumnParallelLinear(config.hidden_size, config.num_heads * d,
                                               config.attention_bias, quant_config,
                                               f"{prefix}.query_proj")
        self.num_heads = self.query_proj.output_size // d
        self.q_norm = RMSNormFp32Scale(d, config.rms_norm_eps)
        theta, scaling = cfg.layer_rope(layer)
        self.rotary_emb = get_rope(d, cfg.rotary_dim, cfg.max_position_embeddings, theta, scaling)
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size,
                                        config.attention_bias, quant_config, f"{prefix}.o_proj")
        self._producer: list[Attention] = []  # a list: not registered as a submodule

    def read_from(self, producer: Attention) -> None:
        if producer.head_dim != self.head_dim:
            raise ValueError(f"KV-shared layer of head size {self.head_dim} cannot read a cache "
                             f"of head size {producer.head_dim}")
        self._producer = [producer]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        (attn,) = self._producer
        t = hidden.shape[0]
        q = self.q_norm(self.query_proj(hidden).reshape(-1, self.head_dim))
        q = q.view(t, self.num_heads, self.head_dim)
        q, _ = kernels.rotary_embedding(positions, q, q[:, :1].contiguous(),
                                        self.rotary_emb.cos_sin_cache, self.rotary_emb.is_neox,
                                        selection=attn.selection)
        out = kernels.paged_attention(q, attn.k_cache, attn.v_cache, get_forward_context(),
                                      attn.scale, sliding_window=attn.sliding_window,
                                      logit_softcap=attn.logit_softcap,
                                      kv_scales=attn.kv_scales, selection=attn.selection)
        return self.o_proj(out.reshape(t, -1))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__()
        shared = kv_producer(config, layer) is not None
        attention_cls = SharedKVAttention if shared else Gemma4Attention
        self.self_attn: nn.Module = attention_cls(config, quant_config, f"{prefix}.self_attn",
                                                  layer)
        wide = shared and bool(hf_value(config, "use_double_wide_mlp", default=False))
        self.mlp = LlamaMLP(dataclasses.replace(
            config, intermediate_size=config.intermediate_size * (2 if wide else 1)),
            quant_config, f"{prefix}.mlp")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNormFp32Scale(h, eps)
        self.post_attention_layernorm = RMSNormFp32Scale(h, eps)
        self.pre_feedforward_layernorm = RMSNormFp32Scale(h, eps)
        self.post_feedforward_layernorm = RMSNormFp32Scale(h, eps)
        self.ple_size = int(hf_value(config, "hidden_size_per_layer_input", default=0) or 0)
        if self.ple_size:
            self.per_layer_input_gate = ReplicatedLinear(h, self.ple_size, False, quant_config,
                                                         f"{prefix}.per_layer_input_gate")
            self.per_layer_projection = ReplicatedLinear(self.ple_size, h, False, quant_config,
                                                         f"{prefix}.per_layer_projection")
            self.post_per_layer_input_norm = RMSNormFp32Scale(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        # a list: its parts are registered on the layer under transformers' names instead
        self._moe: list[Gemma4MoE] = []
        if hf_value(config, "enable_moe_block", default=False):
            moe = Gemma4MoE(config)
            for name, child in moe.named_children():
                self.add_module(name, child)
            self._moe = [moe]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                per_layer_input: torch.Tensor | None) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self._moe:
            mlp_out = self._moe[0](hidden, mlp_out)
        hidden = hidden + self.post_feedforward_layernorm(mlp_out)
        if self.ple_size:
            assert per_layer_input is not None
            gated = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh")
            projected = self.per_layer_projection(gated * per_layer_input)
            hidden = hidden + self.post_per_layer_input_norm(projected)
        return hidden * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        super().__init__()
        h, n = config.hidden_size, config.num_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h)
        self.embed_scale = h**0.5
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, quant_config,
                                                       f"model.layers.{i}", i) for i in range(n))
        for i, layer in enumerate(self.layers):
            producer = kv_producer(config, i)
            if producer is not None:
                source = cast(Gemma4Attention, self.layers[producer].self_attn)
                cast(SharedKVAttention, layer.self_attn).read_from(source.attn)
        self.norm = RMSNormFp32Scale(h, config.rms_norm_eps)
        self.ple_size = p = int(hf_value(config, "hidden_size_per_layer_input", default=0) or 0)
        if p:
            vocab = int(hf_value(config, "vocab_size_per_layer_input",
                                 default=config.vocab_size))
            self.embed_tokens_per_layer = VocabParallelEmbedding(vocab, n * p)
            self.per_layer_model_projection = ReplicatedLinear(
                h, n * p, False, quant_config, "model.per_layer_model_projection")
            self.per_layer_projection_norm = RMSNormFp32Scale(p, config.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: token-identity and context parts of the per-layer embeddings."""
        n, p = len(self.layers), self.ple_size
        table = self.embed_tokens_per_layer(input_ids)
        identity = (table * torch.tensor(p**0.5, dtype=table.dtype)).view(-1, n, p)
        context = self.per_layer_model_projection(embeds) * embeds.new_tensor(
            self.embed_scale**-1)
        context = self.per_layer_projection_norm(context.reshape(-1, p)).view(-1, n, p)
        return (context + identity) * embeds.new_tensor(2.0**-0.5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        # transformers rounds the scale to the activation dtype first; so do we.
        hidden = embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.ple_size else None
        for i, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, None if per_layer is None else per_layer[:, i])
        return self.norm(hidden)


class Gemma4ForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = \
        LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        super().__init__(config, quant_config)
        num_experts = int(hf_value(config, "num_experts", default=0) or 0)
        if hf_value(config, "enable_moe_block", default=False):
            # per instance: the keys depend on the expert count
            self.packed_modules_mapping = {  # type: ignore[misc]
                **expert_weights_mapping(num_experts), **type(self).packed_modules_mapping}
        if config.layer_types and config.layer_types[-1] != "full_attention":
            config.layer_types[-1] = "full_attention"  # as transformers forces it
        self.model = Gemma4Model(config, quant_config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.shared_kv = {i for i in range(config.num_layers) if kv_producer(config, i) is not None}
        self.k_eq_v = {i for i in range(config.num_layers) if k_eq_v(config, i)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layer(self, name: str) -> int | None:
        parts = name.split(".")
        return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else None

    def checkpoint_name(self, name: str) -> str:
        if self._layer(name) in self.shared_kv:
            return name.replace(".self_attn.q_proj.", ".self_attn.query_proj.")
        return name

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        experts = split_experts(name, tensor)
        if experts is not None:
            yield from experts
            return
        yield name, tensor
        if self._layer(name) in self.k_eq_v and ".self_attn.k_proj." in name:
            yield name.replace(".k_proj.", ".v_proj."), tensor  # values = raw keys


class Gemma4ForConditionalGeneration(TextOnlyMixin, Gemma4ForCausalLM):
    """The text part of Gemma 4 checkpoints (vision and audio towers skipped)."""

