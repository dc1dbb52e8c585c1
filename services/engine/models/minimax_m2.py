"""MiniMax-M2 (`MiniMaxM2ForCausalLM`, MiniMaxAI/MiniMax-M2 / M2.1): llama attention without
biases whose q and k are RMS-normed over all heads together (`q_norm` [Hq * D], `k_norm`
[Hk * D], before the rotary), partial rotary in halves (`rotary_dim` / `partial_rotary_factor`),
and a mixture of experts in every layer: Mixtral's layout (`block_sparse_moe`, experts w1 / w3 /
w2) with DeepSeek-V3-style routing - sigmoid scores of the router logits (computed in the model
dtype), `e_score_correction_bias` added only to choose the top-k, the chosen scores renormalised
to sum 1.

The q/k norms span every head, so under tensor parallelism a rank would need the other ranks'
heads' sums of squares: MiniMax-M2 runs at tensor-parallel size 1 only (refused otherwise).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from flotilla.services.engine.distributed import get_tp_size
from flotilla.services.engine.layers import RMSNorm
from flotilla.services.engine.layers.moe import FusedMoE, RoutingConfig, expert_weights_mapping
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from flotilla.services.engine.models.moe_base import MoECausalLM, MoEDecoderLayer, hf_value
from flotilla.services.engine.quant.base import QuantConfig


class MiniMaxM2Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        if get_tp_size() > 1:
            raise ValueError("MiniMax-M2's q/k norms span all heads: tensor parallelism is not "
                             "supported for it")
        super().__init__(config, quant_config, prefix, layer)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)

    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        return False, False

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = q.shape[0]
        return (self.q_norm(q.reshape(t, -1)).view(q.shape),
                self.k_norm(k.reshape(t, -1)).view(k.shape))


class MiniMaxM2DecoderLayer(MoEDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = MiniMaxM2Attention

    def make_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> nn.Module:
        routing = RoutingConfig(num_experts=int(hf_value(config, "num_local_experts")),
                                top_k=int(hf_value(config, "num_experts_per_tok")),
                                scoring="sigmoid", renormalize=True, correction_bias=True)
        return FusedMoE(config.hidden_size, config.intermediate_size, routing,
                        hidden_act=config.hidden_act, quant_config=quant_config, prefix=prefix)


class MiniMaxM2ForCausalLM(MoECausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = MiniMaxM2DecoderLayer

    def expert_mapping(self, config: ModelConfig) -> dict[str, tuple[str, str | int]]:
        mapping = expert_weights_mapping(int(hf_value(config, "num_local_experts")),
                                         ("w1", "w3", "w2"), source="block_sparse_moe.experts",
                                         target="mlp.experts")
        mapping["block_sparse_moe.gate"] = ("mlp.gate", "router")
        return mapping

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".block_sparse_moe.e_score_correction_bias",
                            ".mlp.gate.e_score_correction_bias")
