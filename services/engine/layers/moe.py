"""Mixture-of-experts block: a router, routed experts through `kernels.fused_moe`, shared experts.

Rules:
- Routing (`Router`, `RoutingConfig`) follows the HF reference of each family. Router logits are
  computed in the model dtype (fp32 with `router_fp32`, as deepseek does, its weight then stored
  in fp32); scores are the softmax
  (fp32) or sigmoid of the logits. Plain top-k picks the k best scores. Grouped top-k (deepseek:
  `n_group` / `topk_group`) first keeps the `topk_group` best groups of experts - a group scores
  its best expert (softmax) or the sum of its best two (sigmoid) - and picks the k best inside
  them. `e_score_correction_bias` is added to the scores only to choose experts; the weights
  are the unbiased scores of the chosen ones, renormalised to sum 1 when `renormalize`, then
  multiplied by `routed_scaling_factor`.
- Experts are split across tensor-parallel ranks (expert parallel): rank r owns experts
  [r * E / tp, (r + 1) * E / tp) and runs them for every token; the ids of other ranks' experts
  are masked to -1 and the routed output is all-reduced. The router is replicated; the shared
  experts are ordinary tensor-parallel MLPs (all-reduced in their down projection).
- Expert weights are stacked per rank: `experts.w13.weight` [E_local, 2I, H] (gate rows, then up
  rows) and `experts.w2.weight` [E_local, H, I]. Checkpoint tensors `experts.{e}.gate_proj/up_proj/
  down_proj` (mixtral: w1/w3/w2) reach them through `expert_weights_mapping`, which a model puts
  first in its `packed_modules_mapping` (before a plain "gate_proj" key could match them).
- Expert weights are float unless the quantization config has an expert method
  (`QuantConfig.get_expert_method`: MXFP4 for gpt-oss, quant/mxfp4.py; GGUF blocks,
  quant/gguf_moe.py), which then registers each stack's parameters (and loads a quantized
  `weight` itself) and runs the experts; other configs apply to the shared experts only.
- gpt-oss: the router has a bias (`router_bias`), the experts biases (`experts.w13.bias`
  [E_local, 2I], `experts.w2.bias` [E_local, H], loaded like the weights' rows) and the clamped
  SwiGLU (`swiglu`, kernels/activation.py) instead of silu_and_mul. llama4: the routing weight
  scales each expert's input instead of its output (`weight_on_input`).
- Expert offload (layers/moe_offload.py): the last experts of a rank may live in host memory
  (`MoEExperts.host`); the device stacks then hold the others and the layer's forward splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flotilla import kernels
from flotilla.kernels.activation import SwigluOAI
from flotilla.kernels.selection import Selecting
from flotilla.services.engine.distributed import divide, get_tp_rank, get_tp_size, tp_all_reduce
from flotilla.services.engine.layers.linear import ReplicatedLinear
from flotilla.services.engine.layers.moe_offload import HostExperts, placement
from flotilla.services.engine.quant.base import ExpertQuantMethod, QuantConfig

SCORING_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    n_group: int | None = None  # grouped top-k when set (with topk_group)
    topk_group: int | None = None
    correction_bias: bool = False  # the router carries e_score_correction_bias [E]
    routed_scaling_factor: float = 1.0
    router_fp32: bool = False
    router_bias: bool = False  # the router linear has a bias (gpt-oss)

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCTIONS:
            raise ValueError(f"unsupported MoE scoring function {self.scoring!r}; supported: "
                             f"{', '.join(SCORING_FUNCTIONS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, {self.num_experts}]")
        if self.n_group and (self.num_experts % self.n_group or not self.topk_group):
            raise ValueError(f"{self.num_experts} experts cannot form {self.n_group} groups "
                             f"(topk_group {self.topk_group})")


class Router(nn.Module):
    """hidden [T, H] -> (topk_weights float32 [T, K], topk_ids int64 [T, K])."""

    def __init__(self, hidden_size: int, routing: RoutingConfig) -> None:
        super().__init__()
        self.routing = routing
        # An fp32 router keeps its weight fp32 (transformers' _keep_in_fp32_modules_strict for
        # GLM-4.5's gate.weight): a checkpoint that stores it in fp32 loses nothing.
        dtype = torch.float32 if routing.router_fp32 else None
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if routing.router_bias:
            self.bias = nn.Parameter(torch.empty(routing.num_experts), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if routing.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(routing.num_experts, dtype=torch.float32), requires_grad=False)

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        """Replicated; accepts a (ignored) shard id so a model can rename the router through
        packed_modules_mapping (mixtral's block_sparse_moe.gate -> mlp.gate)."""
        if param.shape != loaded.shape:
            raise ValueError(f"router weight shape {tuple(loaded.shape)} != {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        if r.router_fp32:
            bias = None if self.bias is None else self.bias.float()
            logits = F.linear(hidden.float(), self.weight.float(), bias)
        else:
            logits = F.linear(hidden, self.weight, self.bias).float()
        scores = logits.softmax(-1) if r.scoring == "softmax" else logits.sigmoid()
        choice = scores + self.e_score_correction_bias if r.correction_bias else scores
        if r.n_group and r.topk_group and r.n_group > 1:
            choice = _mask_to_best_groups(choice, r.n_group, r.topk_group,
                                          top2_sum=r.scoring == "sigmoid")
        topk_ids = choice.topk(r.top_k, dim=-1).indices
        topk_weights = scores.gather(1, topk_ids)
        if r.renormalize:
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        if r.routed_scaling_factor != 1.0:
            topk_weights = topk_weights * r.routed_scaling_factor
        return topk_weights, topk_ids


def _mask_to_best_groups(choice: torch.Tensor, n_group: int, topk_group: int,
                         top2_sum: bool) -> torch.Tensor:
    grouped = choice.view(choice.shape[0], n_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if top2_sum else grouped.amax(-1)
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


class ExpertStack(nn.Module):
    """`weight` [E_local, out, in]: one nn.Linear-layout matrix per local expert, `parts` row
    blocks each (2 for gate + up), and with `bias` a `bias` [E_local, out]. Shard id "e:part"
    loads expert e's block `part` (of the weight or the bias); experts of other ranks are
    skipped."""

    def __init__(self, num_local: int, first_expert: int, out_size: int, in_size: int,
                 parts: int, bias: bool = False,
                 quant_method: ExpertQuantMethod | None = None) -> None:
        super().__init__()
        self.first_expert, self.num_local = first_expert, num_local
        self.part_rows = out_size // parts
        self.expert_method = quant_method  # loads its own `weight` (GGUF blocks: quant/gguf_moe.py)
        if quant_method is None:
            self.weight = nn.Parameter(torch.empty(num_local, out_size, in_size),
                                       requires_grad=False)
        else:  # its packed tensors instead (loaded per expert row block like the weight)
            quant_method.create_weights(self, num_local, out_size, in_size)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(num_local, out_size), requires_grad=False)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        expert, part = (int(v) for v in shard_id.split(":"))
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:
            return
        dst = param.data[local].narrow(0, part * self.part_rows, self.part_rows)
        if self.expert_method is not None and param is getattr(self, "weight", None):
            self.expert_method.load(self, dst, loaded, part)
            return
        if dst.shape != loaded.shape:
            raise ValueError(f"expert {expert} tensor shape {tuple(loaded.shape)} does not match "
                             f"{tuple(dst.shape)}")
        dst.copy_(loaded)


class MoEExperts(nn.Module, Selecting):
    """This rank's experts, stacked: w13 (gate + up) and w2 (down); with offload, the device
    stacks hold local experts [0, D) and `host` the rest."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 bias: bool = False, swiglu: SwigluOAI | None = None,
                 quant_method: ExpertQuantMethod | None = None,
                 weight_on_input: bool = False, prefix: str = "",
                 host_method: ExpertQuantMethod | None = None,
                 activation: str = "silu") -> None:
        super().__init__()
        if weight_on_input and quant_method is not None and not quant_method.takes_input_weight:
            raise ValueError("quantized experts take the routing weight on their output only")
        if activation != "silu" and quant_method is not None:
            raise ValueError(f"quantized experts run silu (or gpt-oss's SwiGLU), not {activation}")
        self.activation = activation
        self.weight_on_input = weight_on_input
        self.tp_size = get_tp_size()
        self.num_local = divide(num_experts, self.tp_size, "expert count")
        self.first_expert = get_tp_rank() * self.num_local
        self.swiglu = swiglu
        self.quant_method = quant_method  # the loader runs its process_after_loading
        on_device, on_host = placement(prefix, self.num_local)
        self.w13 = ExpertStack(on_device, self.first_expert, 2 * intermediate_size,
                               hidden_size, parts=2, bias=bias, quant_method=quant_method)
        self.w2 = ExpertStack(on_device, self.first_expert, hidden_size, intermediate_size,
                              parts=1, bias=bias, quant_method=quant_method)
        self.host = (HostExperts(self, on_host, hidden_size, intermediate_size, bias,
                                 host_method, ExpertStack) if on_host else None)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            local = topk_ids - self.first_expert
            topk_ids = torch.where((local >= 0) & (local < self.num_local), local, -1)
        if self.host is not None:
            return self.host.split_forward(self, hidden, topk_weights, topk_ids)
        return self.run_device(hidden, topk_weights, topk_ids)

    def run_device(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
        """The device stacks' experts for local ids (-1: none; split_forward masks the host's)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        return kernels.fused_moe(hidden, self.w13.weight, self.w2.weight, topk_weights, topk_ids,
                                 self.w13.bias, self.w2.bias, self.swiglu, self.weight_on_input,
                                 self.activation, selection=self.selection)


class FusedMoE(nn.Module):
    """Router + routed experts (+ shared experts, optionally behind a sigmoid gate).

    `shared_experts` is any [T, H] -> [T, H] module (usually a gated MLP); it is registered under
    `shared_name` so checkpoint names match (qwen2_moe "shared_expert", deepseek
    "shared_experts"). `shared_expert_gate` adds qwen2_moe's sigmoid(Linear(H, 1)) gate.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, routing: RoutingConfig,
                 shared_experts: nn.Module | None = None, shared_name: str = "shared_experts",
                 shared_expert_gate: bool = False, hidden_act: str = "silu",
                 expert_bias: bool = False, swiglu: SwigluOAI | None = None,
                 quant_config: QuantConfig | None = None, prefix: str = "",
                 weight_on_input: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu" and swiglu is None:
            raise ValueError(f"fused MoE experts support the silu gated activation only, got "
                             f"{hidden_act!r}")
        self.gate = Router(hidden_size, routing)

        def method() -> ExpertQuantMethod | None:
            return (quant_config.get_expert_method(f"{prefix}.experts")
                    if quant_config is not None else None)

        self.experts = MoEExperts(routing.num_experts, hidden_size, intermediate_size,
                                  expert_bias, swiglu, method(), weight_on_input, prefix,
                                  method())
        self.shared_name = shared_name if shared_experts is not None else None
        if shared_experts is not None:
            self.add_module(shared_name, shared_experts)
        self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, bias=False)
                                   if shared_expert_gate else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden)
        out = self.experts(hidden, topk_weights, topk_ids)
        out = tp_all_reduce(out)  # identity at world size 1
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        return out


def expert_weights_mapping(
    num_experts: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    source: str = "experts", target: str = "experts",
) -> dict[str, tuple[str, str | int]]:
    """packed_modules_mapping entries routing `{source}.{e}.{gate|up|down}` checkpoint tensors
    onto the stacks `{target}.w13` / `{target}.w2` (shard ids "e:part")."""
    gate, up, down = names
    mapping: dict[str, tuple[str, str | int]] = {}
    for e in range(num_experts):
        mapping[f"{source}.{e}.{gate}"] = (f"{target}.w13", f"{e}:0")
        mapping[f"{source}.{e}.{up}"] = (f"{target}.w13", f"{e}:1")
        mapping[f"{source}.{e}.{down}"] = (f"{target}.w2", f"{e}:0")
    return mapping
