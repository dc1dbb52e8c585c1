"""Llama 4 text (`Llama4ForCausalLM`; the language model of `Llama4ForConditionalGeneration`,
Scout / Maverick, served text-only).

- Attention: rope in interleaved pairs (complex multiply) with llama3 scaling, on the layers
  `no_rope_layers` marks; those attend within chunks of `attention_chunk_size` positions
  (`layer_types` "chunked_attention") and, with `use_qk_norm`, L2-normalise q and k per head
  after the rope (no weight). The other layers (every 4th: NoPE) attend globally and, with
  `attn_temperature_tuning`, scale q by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1.
- MLP (`feed_forward` in checkpoints): layers in `moe_layers` (else every
  `interleave_moe_layer_step`-th) are a top-k MoE over sigmoid scores of the top logits, the
  score scaling each chosen expert's input, plus an always-on `shared_expert`; the others a
  dense MLP of `intermediate_size_mlp`. Checkpoints stack the experts: `experts.gate_up_proj`
  [E, H, 2I] (gate columns first) and `experts.down_proj` [E, I, H].
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from flotilla.services.engine.layers.moe import FusedMoE, RoutingConfig
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.llama import LlamaAttention, LlamaDecoderLayer
from flotilla.services.engine.models.moe_base import (
    MoECausalLM,
    MoEDecoderLayer,
    hf_value,
    shared_mlp,
)
from flotilla.services.engine.models.text_only import TextOnlyMixin
from flotilla.services.engine.quant.base import QuantConfig


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32 (transformers' Llama4TextL2Norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(LlamaAttention):
    rope_is_neox: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> None:
        super().__init__(config, quant_config, prefix, layer)
        self.eps = config.rms_norm_eps
        self.l2_qk = self.use_rope and bool(hf_value(config, "use_qk_norm", default=True))
        self.temperature_tuning = bool(hf_value(config, "attn_temperature_tuning", default=True))
        self.floor_scale = float(hf_value(config, "floor_scale", default=8192))
        self.attn_scale = float(hf_value(config, "attn_scale", default=0.1))

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = super().rotate(positions, q, k)
        if self.l2_qk:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        return q, k

    def nope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.temperature_tuning:
            return q, k
        scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale))
        scale = scale * self.attn_scale + 1.0
        return (q * scale[:, None, None]).to(q.dtype), k


class Llama4DecoderLayer(MoEDecoderLayer):
    attention_cls: ClassVar[type[LlamaAttention]] = Llama4Attention

    def make_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 layer: int) -> nn.Module:
        moe_layers = hf_value(config, "moe_layers")
        if moe_layers is None:
            step = int(hf_value(config, "interleave_moe_layer_step", default=1))
            moe_layers = list(range(step - 1, config.num_layers, step))
        if layer not in moe_layers:
            inter = int(hf_value(config, "intermediate_size_mlp", default=config.intermediate_size))
            return shared_mlp(config, inter, quant_config, prefix)
        routing = RoutingConfig(num_experts=int(hf_value(config, "num_local_experts")),
                                top_k=int(hf_value(config, "num_experts_per_tok")),
                                scoring="sigmoid")
        shared = shared_mlp(config, config.intermediate_size, quant_config,
                            f"{prefix}.shared_expert")
        return FusedMoE(config.hidden_size, config.intermediate_size, routing, shared,
                        "shared_expert", hidden_act=config.hidden_act, weight_on_input=True)


class Llama4ForCausalLM(MoECausalLM):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = Llama4DecoderLayer
    stacked_gate_up: ClassVar[str | None] = "halves"

    def expert_mapping(self, config: ModelConfig) -> dict[str, tuple[str, str | int]]:
        mapping = super().expert_mapping(config)
        mapping["mlp.router"] = ("mlp.gate", "router")
        return mapping

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".feed_forward.", ".mlp.")


class Llama4ForConditionalGeneration(TextOnlyMixin, Llama4ForCausalLM):
    """The text part of Llama 4 Scout / Maverick checkpoints (the vision model is skipped)."""
