"""GLM-4 (`GlmForCausalLM`, glm-4-9b-chat-hf) and GLM-4-0414 (`Glm4ForCausalLM`): llama with a
fused `gate_up_proj` checkpoint tensor, biased q/k/v, and rotary on the first half of each head
in interleaved pairs (GPT-J layout). GLM-4-0414 adds norms after attention and after the MLP."""

from __future__ import annotations

from typing import ClassVar

from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)


class GlmAttention(LlamaAttention):
    rope_is_neox: ClassVar[bool] = False

    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        return config.attention_bias, False


class GlmDecoderLayer(LlamaDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = GlmAttention


class GlmForCausalLM(LlamaForCausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = GlmDecoderLayer


class Glm4DecoderLayer(GlmDecoderLayer):
    norm_names: ClassVar[tuple[str | None, ...]] = (
        "input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
        "post_mlp_layernorm")


class Glm4ForCausalLM(GlmForCausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Glm4DecoderLayer
