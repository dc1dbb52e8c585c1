"""Qwen3 (dense): llama with a per-head RMSNorm on q and k before the rotary (`q_norm`,
`k_norm` over head_dim); biases follow `attention_bias`."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from flotilla.services.engine.layers import RMSNorm
from flotilla.services.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)


class Qwen3Attention(LlamaAttention):
    qk_norm_cls: ClassVar[type[nn.Module] | None] = RMSNorm


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Qwen3DecoderLayer
