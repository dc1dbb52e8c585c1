"""DeepSeek-V3 / R1 (and Kimi-K2-style configs): DeepSeek-V2's MLA and layout with sigmoid
routing, `e_score_correction_bias` (used only to choose experts), grouped top-k (n_group /
topk_group, a group scoring the sum of its best two), renormalised weights scaled by
routed_scaling_factor. `rope_interleave` (default true) selects interleaved rope pairs. The
multi-token-prediction layer (layer index num_hidden_layers) is skipped."""

from __future__ import annotations

from typing import ClassVar

from flotilla.services.engine.layers.moe import RoutingConfig
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.deepseek_v2 import (
    DeepseekV2Attention,
    DeepseekV2DecoderLayer,
    DeepseekV2ForCausalLM,
)
from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from flotilla.services.engine.models.moe_base import hf_value


class DeepseekV3Attention(DeepseekV2Attention):
    @staticmethod
    def rope_interleaved(config: ModelConfig) -> bool:
        return bool(hf_value(config, "rope_interleave", default=True))


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = DeepseekV3Attention  # type: ignore[assignment]

    @staticmethod
    def routing(config: ModelConfig) -> RoutingConfig:
        return RoutingConfig(
            num_experts=int(hf_value(config, "n_routed_experts")),
            top_k=int(hf_value(config, "num_experts_per_tok")),
            scoring=str(hf_value(config, "scoring_func", default="sigmoid")),
            renormalize=bool(hf_value(config, "norm_topk_prob", default=True)),
            n_group=hf_value(config, "n_group"),
            topk_group=hf_value(config, "topk_group"),
            correction_bias=True,
            routed_scaling_factor=float(hf_value(config, "routed_scaling_factor", default=1.0)),
            router_fp32=True,
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = DeepseekV3DecoderLayer


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) with **dense** attention: DeepSeek-V3's MLA and
    MoE; its sparse attention's lightning indexer (`self_attn.indexer.*`, loaded by transformers)
    is skipped. The indexer keeps each query's `index_topk` (2048) best keys, so up to that many
    tokens of context the dense attention is exact; past it every key is attended instead of the
    selected 2048 (a fallback, not DSA)."""

    def skip_weight(self, name: str) -> bool:
        return ".self_attn.indexer." in name or super().skip_weight(name)
