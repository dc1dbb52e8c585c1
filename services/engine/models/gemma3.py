"""Gemma 3 (text): Gemma 2 with (1 + w) RMSNorm on q and k per head, separate rope for sliding
(local theta) and global layers, five sliding layers per global one by default and no
soft-capping unless configured; also the text part of `Gemma3ForConditionalGeneration`."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from flotilla.services.engine.layers import GemmaRMSNorm
from flotilla.services.engine.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from flotilla.services.engine.models.text_only import TextOnlyMixin


class Gemma3Attention(LlamaAttention):
    qk_norm_cls: ClassVar[type[nn.Module] | None] = GemmaRMSNorm


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Gemma3DecoderLayer
    sliding_window_pattern: ClassVar[int] = 6


class Gemma3ForConditionalGeneration(TextOnlyMixin, Gemma3ForCausalLM):
    """Text part of Gemma 3 vision-language checkpoints (4B, 12B, 27B)."""
