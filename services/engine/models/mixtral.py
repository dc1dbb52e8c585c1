"""Mixtral: llama attention (optional sliding window) with a softmax top-k MoE in every layer.

Checkpoints name the MoE block `block_sparse_moe` (router `gate`, experts w1 = gate, w3 = up,
w2 = down); the mapping below renames it onto the skeleton's `mlp` slot.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from flotilla.services.engine.layers.moe import FusedMoE, RoutingConfig, expert_weights_mapping
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import LlamaDecoderLayer
from flotilla.services.engine.models.moe_base import MoECausalLM, MoEDecoderLayer, hf_value
from flotilla.services.engine.quant.base import QuantConfig


class MixtralDecoderLayer(MoEDecoderLayer):
    def make_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> nn.Module:
        routing = RoutingConfig(num_experts=int(hf_value(config, "num_local_experts")),
                                top_k=int(hf_value(config, "num_experts_per_tok")),
                                renormalize=True)
        return FusedMoE(config.hidden_size, config.intermediate_size, routing,
                        hidden_act=config.hidden_act, quant_config=quant_config, prefix=prefix)


class MixtralForCausalLM(MoECausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = MixtralDecoderLayer

    def expert_mapping(self, config: ModelConfig) -> dict[str, tuple[str, str | int]]:
        mapping = expert_weights_mapping(int(hf_value(config, "num_local_experts")),
                                         ("w1", "w3", "w2"), source="block_sparse_moe.experts",
                                         target="mlp.experts")
        mapping["block_sparse_moe.gate"] = ("mlp.gate", "router")
        return mapping
