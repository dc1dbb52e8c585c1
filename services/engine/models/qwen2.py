"""Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen, QwQ): llama with biased q/k/v projections
(o_proj has none); sliding windows only on the layers `layer_types` marks, when enabled."""

from __future__ import annotations

from typing import ClassVar

from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Qwen2DecoderLayer
