"""Qwen3-MoE: qwen3 attention (per-head q/k RMSNorm) with qwen2_moe's routed experts and no
shared expert."""

from __future__ import annotations

from typing import ClassVar

from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from flotilla.services.engine.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM
from flotilla.services.engine.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Qwen3Attention


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Qwen3MoeDecoderLayer
