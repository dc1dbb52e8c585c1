"""Qwen1.5-MoE / Qwen2-MoE: qwen2 attention (biased q/k/v) with a softmax top-k MoE plus one
shared expert behind a sigmoid gate (`shared_expert`, `shared_expert_gate`). Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` rhythm, keep a dense MLP."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from flotilla.services.engine.layers.moe import FusedMoE, RoutingConfig
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from flotilla.services.engine.models.moe_base import (
    MoECausalLM,
    MoEDecoderLayer,
    hf_value,
    shared_mlp,
)
from flotilla.services.engine.models.qwen2 import Qwen2Attention
from flotilla.services.engine.quant.base import QuantConfig


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Qwen2Attention

    def make_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> nn.Module:
        num_experts = int(hf_value(config, "num_experts", "num_local_experts", default=0))
        step = int(hf_value(config, "decoder_sparse_step", default=1))
        if (layer in hf_value(config, "mlp_only_layers", default=[]) or num_experts == 0
                or (layer + 1) % step):
            return LlamaMLP(config, quant_config, prefix)
        routing = RoutingConfig(num_experts, int(hf_value(config, "num_experts_per_tok")),
                                renormalize=bool(hf_value(config, "norm_topk_prob",
                                                          default=False)))
        shared_size = hf_value(config, "shared_expert_intermediate_size")
        shared = (shared_mlp(config, int(shared_size), quant_config, f"{prefix}.shared_expert")
                  if shared_size else None)
        return FusedMoE(config.hidden_size, int(hf_value(config, "moe_intermediate_size")),
                        routing, shared, "shared_expert", shared_expert_gate=shared is not None,
                        hidden_act=config.hidden_act, quant_config=quant_config, prefix=prefix)


class Qwen2MoeForCausalLM(MoECausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Qwen2MoeDecoderLayer
