"""gpt-oss (`GptOssForCausalLM`, gpt-oss-20b / 120b): llama attention with biases on q/k/v/o and
a learned attention sink per head (layers/attention.py), sliding-window (128) layers alternating
with full ones (`layer_types`), YaRN rope in halves (neox); every layer is a mixture of experts
whose router is a biased linear (softmax over the top-k logits = softmax renormalised over the
chosen experts) and whose experts have biases and the clamped SwiGLU (`swiglu_alpha`,
`swiglu_limit`) over `intermediate_size`.

Checkpoints name the router `mlp.router` and stack the experts: `mlp.experts.gate_up_proj`
[E, H, 2I] (x @ W layout, gate and up columns interleaved: gate = even, up = odd) with
`gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H] with `down_proj_bias` [E, H];
`MoECausalLM.checkpoint_tensors` turns them into the per-expert nn.Linear-layout tensors the
expert stacks load. The published checkpoints keep the experts in MXFP4 (`*_blocks`
[E, out, in / 32, 16] and `*_scales` [E, out, in / 32], rows interleaved the same way;
quant/mxfp4.py serves them). The
attention sinks are `self_attn.sinks` [num_heads]. Its RMSNorms scale the fp32 normalised row
and round once (`RMSNormFp32Scale`), as transformers' GptOssRMSNorm does.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from flotilla.kernels.activation import SwigluOAI
from flotilla.services.engine.layers import RMSNormFp32Scale
from flotilla.services.engine.layers.moe import FusedMoE, RoutingConfig
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from flotilla.services.engine.models.moe_base import MoECausalLM, MoEDecoderLayer, hf_value
from flotilla.services.engine.quant.base import QuantConfig


class GptOssAttention(LlamaAttention):
    attention_sinks: ClassVar[bool] = True


class GptOssDecoderLayer(MoEDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = GptOssAttention
    norm_cls: ClassVar[type[nn.Module]] = RMSNormFp32Scale  # scale in fp32, one rounding

    def make_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> nn.Module:
        routing = RoutingConfig(num_experts=int(hf_value(config, "num_local_experts")),
                                top_k=int(hf_value(config, "num_experts_per_tok")),
                                renormalize=True, router_bias=True)
        swiglu = SwigluOAI(float(hf_value(config, "swiglu_alpha", default=1.702)),
                           float(hf_value(config, "swiglu_limit", default=7.0)))
        return FusedMoE(config.hidden_size, config.intermediate_size, routing,
                        expert_bias=True, swiglu=swiglu, quant_config=quant_config,
                        prefix=prefix)


class GptOssForCausalLM(MoECausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = GptOssDecoderLayer
    stacked_gate_up: ClassVar[str | None] = "interleaved"

    def expert_mapping(self, config: ModelConfig) -> dict[str, tuple[str, str | int]]:
        mapping = super().expert_mapping(config)
        mapping["mlp.router"] = ("mlp.gate", "router")
        return mapping

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
