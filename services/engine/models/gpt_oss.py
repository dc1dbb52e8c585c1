"""gpt-oss (`GptOssForCausalLM`, gpt-oss-20b / 120b): llama attention with biases on q/k/v/o and
a learned attention sink per head (layers/attention.py), sliding-window (128) layers alternating
with full ones (`layer_types`), YaRN rope in halves (neox); every layer is a mixture of experts
whose router is a biased linear (softmax over the top-k logits = softmax renormalised over the
chosen experts) and whose experts have biases and the clamped SwiGLU (`swiglu_alpha`,
`swiglu_limit`) over `intermediate_size`.

Checkpoints name the router `mlp.router` and stack the experts: `mlp.experts.gate_up_proj`
[E, H, 2I] (x @ W layout, gate and up columns interleaved: gate = even, up = odd) with
`gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H] with `down_proj_bias` [E, H];
`checkpoint_tensors` turns them into the per-expert nn.Linear-layout tensors the expert stacks
load. The published checkpoints keep the experts in MXFP4 (`*_blocks` [E, out, in / 32, 16] and
`*_scales` [E, out, in / 32], rows interleaved the same way; quant/mxfp4.py serves them). The
attention sinks are `self_attn.sinks` [num_heads].
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from kernels.activation import SwigluOAI
from services.engine.layers.moe import FusedMoE, RoutingConfig
from services.engine.model_config import ModelConfig
from services.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from services.engine.models.moe_base import MoECausalLM, MoEDecoderLayer, hf_value
from services.engine.quant.base import QuantConfig

# suffixes of the stacked expert tensors of a checkpoint (float, or MXFP4 blocks and scales)
_STACKED = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj",
            "experts.down_proj_bias", "experts.gate_up_proj_blocks", "experts.gate_up_proj_scales",
            "experts.down_proj_blocks", "experts.down_proj_scales")


class GptOssAttention(LlamaAttention):
    attention_sinks: ClassVar[bool] = True


class GptOssDecoderLayer(MoEDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = GptOssAttention

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

    def expert_mapping(self, config: ModelConfig) -> dict[str, tuple[str, str | int]]:
        mapping = super().expert_mapping(config)
        mapping["mlp.router"] = ("mlp.gate", "router")
        return mapping

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor
                           ) -> Iterable[tuple[str, torch.Tensor]]:
        stacked = next((s for s in _STACKED if name.endswith(f".{s}")), None)
        if stacked is None:
            return super().checkpoint_tensors(name, tensor)
        experts = name.removesuffix(stacked.removeprefix("experts.")).rstrip(".")
        return _per_expert(experts, stacked, tensor)


def _per_expert(prefix: str, stacked: str, tensor: torch.Tensor
                ) -> Iterable[tuple[str, torch.Tensor]]:
    """`{prefix}.{e}.{gate,up,down}_proj.{weight,bias,blocks,scales}` of a stacked expert
    tensor. Float weights are [in, out] (x @ W) with gate / up interleaved in the columns; MXFP4
    blocks [out, in / 32, 16] and scales [out, in / 32] are nn.Linear-major with gate / up
    interleaved in the rows."""
    proj, _, kind = stacked.removeprefix("experts.").partition("_proj")
    kind = kind.removeprefix("_") or "weight"
    for e, t in enumerate(tensor):
        if kind == "weight":
            t = t.t()  # [out, in]
        elif kind == "blocks":
            t = t.flatten(-2)  # [out, in / 2]
        if proj == "down":
            yield f"{prefix}.{e}.down_proj.{kind}", t
        else:
            yield f"{prefix}.{e}.gate_proj.{kind}", t[0::2]
            yield f"{prefix}.{e}.up_proj.{kind}", t[1::2]
