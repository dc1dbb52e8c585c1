"""Gemma 4's mixture-of-experts block (gemma-4-26B-A4B, `enable_moe_block`): in every layer a
routed expert branch runs beside the dense MLP, both on the residual stream after attention.

    dense  = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))
    routed = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h)))
    h      = h + post_feedforward_layernorm(dense + routed)

The router (`Gemma4Router`, checkpoint `router.*`) reads h itself: a weightless RMSNorm, times
a learned `scale` [H] and H^-0.5, a linear `proj` [E, H], softmax in fp32, top-k renormalised to
sum 1, each weight times its expert's `per_expert_scale`. Experts (`experts.gate_up_proj`
[E, 2I, H], gate rows first, and `experts.down_proj` [E, H, I], nn.Linear layout) run
gelu_tanh(gate) * up (`hidden_activation`) through kernels.fused_moe; the loader splits the
stacks per expert (`split_experts`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from flotilla.services.engine.distributed import tp_all_reduce
from flotilla.services.engine.layers import RMSNormFp32Scale
from flotilla.services.engine.layers.moe import MoEExperts
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.moe_base import hf_value


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


class Gemma4Router(nn.Module):
    """hidden [T, H] -> (topk_weights fp32 [T, K], topk_ids int64 [T, K])."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k, self.eps, self.root = top_k, eps, hidden_size**-0.5
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.proj.weight.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers' order and dtypes: (norm * scale) * H^-0.5 in the model dtype
        x = _rms(hidden, self.eps) * self.scale * self.root
        probs = self.proj(x).softmax(-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4MoE(nn.Module):
    """The routed branch with its three norms; `forward(h, dense)` returns the sum the layer's
    post_feedforward_layernorm takes. Registered on the decoder layer under transformers'
    names (router, experts, pre_feedforward_layernorm_2, post_feedforward_layernorm_1/2)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        num_experts = int(hf_value(config, "num_experts"))
        self.router = Gemma4Router(h, num_experts, int(hf_value(config, "top_k_experts")), eps)
        act = str(hf_value(config, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"))
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 4 experts with activation {act!r} are not supported")
        self.experts = MoEExperts(num_experts, h, int(hf_value(config, "moe_intermediate_size")),
                                  activation="gelu_tanh")
        self.pre_feedforward_layernorm_2 = RMSNormFp32Scale(h, eps)
        self.post_feedforward_layernorm_1 = RMSNormFp32Scale(h, eps)
        self.post_feedforward_layernorm_2 = RMSNormFp32Scale(h, eps)

    def forward(self, hidden: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(hidden)
        routed = self.experts(self.pre_feedforward_layernorm_2(hidden), weights, ids)
        routed = self.post_feedforward_layernorm_2(tp_all_reduce(routed))
        return self.post_feedforward_layernorm_1(dense) + routed


def split_experts(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]] | None:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` of a stacked Gemma 4 expert tensor
    (None: not one)."""
    if name.endswith(".experts.gate_up_proj"):
        prefix, half = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
        return [item for e, t in enumerate(tensor) for item in (
            (f"{prefix}.{e}.gate_proj.weight", t[:half]),
            (f"{prefix}.{e}.up_proj.weight", t[half:]))]
    if name.endswith(".experts.down_proj"):
        prefix = name.removesuffix(".down_proj")
        return [(f"{prefix}.{e}.down_proj.weight", t) for e, t in enumerate(tensor)]
    return None
