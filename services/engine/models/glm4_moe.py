"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): llama attention with biased q/k/v (no o_proj bias),
rotary on the first `partial_rotary_factor` (0.5) of each head in halves (neox layout), per-head
RMSNorm on q and k when `use_qk_norm`; the MLP is DeepSeek-V3's: dense for the first
`first_k_dense_replace` layers, then sigmoid routing with `e_score_correction_bias` (choice only),
grouped top-k (`n_group` / `topk_group`), renormalised weights scaled by `routed_scaling_factor`,
plus `n_shared_experts` shared experts.

The multi-token-prediction layers (`num_nextn_predict_layers`, stored as layers
num_hidden_layers.. in the checkpoint) are skipped: generation does not use them (no
speculative decoding here)."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from flotilla.services.engine.layers import RMSNorm
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.deepseek_v3 import DeepseekV3DecoderLayer
from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from flotilla.services.engine.models.moe_base import MoECausalLM, hf_value


class Glm4MoeAttention(LlamaAttention):
    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        return config.attention_bias, False

    @classmethod
    def qk_norm(cls, config: ModelConfig) -> type[nn.Module] | None:
        return RMSNorm if hf_value(config, "use_qk_norm", default=False) else None


class Glm4MoeDecoderLayer(DeepseekV3DecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Glm4MoeAttention


class Glm4MoeForCausalLM(MoECausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Glm4MoeDecoderLayer
