"""Gemma 2: llama with (1 + w) RMSNorms before and after both attention and MLP, embeddings
scaled by sqrt(hidden), GELU-tanh MLP, tanh soft-capping of attention scores and final logits,
attention scale query_pre_attn_scalar^-1/2, and sliding-window layers alternating with global
ones (every second layer global when the config does not list `layer_types`)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from flotilla.services.engine.layers import GemmaRMSNorm
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from flotilla.services.engine.quant.base import QuantConfig


class Gemma2DecoderLayer(LlamaDecoderLayer):
    norm_cls: ClassVar[type[nn.Module]] = GemmaRMSNorm
    norm_names: ClassVar[tuple[str | None, ...]] = (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm")


class Gemma2Model(LlamaModel):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None,
                 layer_cls: type[nn.Module], norm_cls: type[nn.Module]) -> None:
        super().__init__(config, quant_config, layer_cls, norm_cls)
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers rounds the scale to the activation dtype first; so do we.
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls: ClassVar[type[LlamaModel]] = Gemma2Model
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Gemma2DecoderLayer
    sliding_window_pattern: ClassVar[int] = 2

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None) -> None:
        config.default_layer_types(self.sliding_window_pattern)
        super().__init__(config, quant_config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
