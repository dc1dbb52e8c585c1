"""Mistral family: Mistral / Ministral (llama with sliding-window attention) and Mistral 3 /
Ministral 3 (YaRN rope from nested `rope_parameters`, llama-4 style query scaling), including the
text part of `Mistral3ForConditionalGeneration` checkpoints.

The sliding window itself is generic (`ModelConfig.layer_sliding_window`): every layer for
Mistral, the `layer_types` ones for Ministral.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from flotilla.services.engine.models.text_only import TextOnlyMixin
from flotilla.services.engine.quant.base import QuantConfig


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with `sliding_window` attention (Mistral 7B v0.1; later versions set it to null)."""


class Ministral3Attention(LlamaAttention):
    """Queries scaled by 1 + beta * log(1 + floor(pos / original_max_position_embeddings)) after
    the rotary (transformers' `get_llama_4_attn_scale`); beta = `llama_4_scaling_beta`."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__(config, quant_config, prefix, layer)
        scaling = config.rope_scaling or {}
        self.beta = scaling.get("llama_4_scaling_beta")
        self.original_max = float(scaling.get("original_max_position_embeddings") or 1)

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = super().rotate(positions, q, k)
        if self.beta is None:
            return q, k
        scale = 1 + self.beta * torch.log(1 + torch.floor(positions / self.original_max))
        return q * scale.to(q.dtype)[:, None, None], k


class Ministral3DecoderLayer(LlamaDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Ministral3Attention


class Ministral3ForCausalLM(LlamaForCausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Ministral3DecoderLayer


class Mistral3ForConditionalGeneration(TextOnlyMixin, Ministral3ForCausalLM):
    """Text part of Mistral 3 / Ministral 3 vision-language checkpoints (config in text_config)."""
