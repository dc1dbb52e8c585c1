"""MoE expert offload: some of a rank's routed experts live in host memory (llama.cpp's
`--cpu-moe` / `--n-cpu-moe N`, the seeds' `--num-experts-offload-per-rank N`).

Rules:
- Which experts go to the host, per layer and rank: layers/expert_placement.py (`ExpertOffload`,
  EngineConfig.expert_offload; its names are re-exported here).
- Host experts are always the highest local ids: the device stack keeps local experts
  [0, D), the host stack [D, E_local). The split forward sends a token's pairs to the side
  that holds each expert; "cpu" adds each host expert's rows to the device side's sum one
  expert after another in ascending order, as the torch reference sums experts, so a split
  fp32 layer equals the unsplit one bit for bit on the CPU (on CUDA index_add_'s atomics
  choose the order). "stream" adds the staged experts' sum at once (within fp32 rounding).
- The host stacks are built on the CPU while the model is built (no transient device copy),
  by a second instance of the layer's expert quant method; checkpoint tensors of host experts
  reach them through the device stacks' weight loaders. After loading, `mode` decides their
  format: "cpu" (default) lets the method pick its CPU format (int4 experts stay int4 groups
  run by torch's int4 CPU matmul; a method without a CPU kernel, such as MXFP4, dequantizes) and
  runs the experts on CPU threads; "stream" runs the method's device post-processing (the host
  tensors visit the device one layer at a time) and copies each step's used experts to the
  device. Host tensors are pinned when CUDA is available.
- "cpu": the router's outputs and the hidden rows go to the host, the device experts run
  meanwhile (queued before the host computes), the host sum comes back and is added. Works at
  any batch; bound by the host's memory bandwidth. "stream": bound by PCIe (the used experts'
  bytes each step); bench/moe_offload.py measures both against the link's bandwidth.
- Both need the step's routing on the host: engines with offload run eagerly (no CUDA graphs,
  EngineConfig).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from flotilla import kernels
from flotilla.services.engine.layers.expert_placement import (
    NO_OFFLOAD,
    ExpertOffload,
    ExpertPlacement,
    OffloadMode,
    building,
    in_layer,
    layer_index,
    placement,
)
from flotilla.services.engine.layers.expert_placement import current as current_offload
from flotilla.services.engine.quant.base import ExpertQuantMethod

if TYPE_CHECKING:
    from flotilla.services.engine.layers.moe import ExpertStack, MoEExperts

__all__ = ["NO_OFFLOAD", "ExpertOffload", "ExpertPlacement", "HostExperts", "OffloadMode",
           "building", "in_layer", "layer_index", "placement", "stack_tensors", "summary"]


def summary(model: nn.Module) -> str:
    """How many experts (and bytes) the model keeps in host memory, for the start-up log."""
    hosts = [m for m in model.modules() if isinstance(m, HostExperts)]
    experts = sum(h.count for h in hosts)
    size = sum(
        t.numel() * t.element_size()
        for h in hosts
        for stack in (h.w13, h.w2)
        for t in stack_tensors(stack).values()
    )
    mode = hosts[0].mode if hosts else "-"
    return (
        f"expert offload: {experts} experts of {len(hosts)} MoE layers in host memory "
        f"({size / 2**30:.2f} GiB), mode {mode}; CUDA graphs off"
    )


def stack_tensors(stack: nn.Module) -> dict[str, torch.Tensor]:
    """The per-expert tensors of a stack (leading dim = its expert count): parameters and the
    buffers a method's post-processing registered."""
    found = {
        **dict(stack.named_parameters(recurse=False)),
        **dict(stack.named_buffers(recurse=False)),
    }
    return {name: t for name, t in found.items() if t is not None}


class _HostPostProcess:
    """The host set's `quant_method` as the loader sees it: its format's post-processing
    (on the CPU, or on the device for "stream"), then the pinning."""

    def __init__(
        self, method: ExpertQuantMethod | None, mode: OffloadMode, device: torch.device
    ) -> None:
        self.method, self.mode, self.device = method, mode, device

    def process_after_loading(self, module: nn.Module) -> None:
        host = cast(HostExperts, module)
        if self.method is not None:
            if self.mode == "stream" and self.device.type != "cpu":
                host.to(self.device)  # this layer's host experts only, then back
                self.method.process_after_loading(host)
                host.to("cpu")
            else:
                self.method.process_after_loading(host)
        if torch.cuda.is_available():
            for stack in (host.w13, host.w2):
                for name, t in stack_tensors(stack).items():
                    pinned = t.data.pin_memory()
                    if name in stack._parameters:
                        cast(nn.Parameter, stack._parameters[name]).data = pinned
                    else:
                        stack._buffers[name] = pinned


class HostExperts(nn.Module):
    """Local experts [first_local, first_local + count) of one MoE layer in host memory, and the
    split forward of their layer (see the module rules)."""

    def __init__(
        self,
        experts: MoEExperts,
        count: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        method: ExpertQuantMethod | None,
        make_stack: Callable[..., ExpertStack],
    ) -> None:
        super().__init__()
        offload = current_offload()
        self.mode: OffloadMode = offload.mode
        self.device = torch.get_default_device()
        self.first_local = experts.num_local - count
        self.count = count
        self.swiglu, self.weight_on_input = experts.swiglu, experts.weight_on_input
        self.activation = experts.activation  # silu or gelu_tanh (Gemma 4 MoE)
        first = experts.first_expert + self.first_local
        with torch.device("cpu"):
            self.w13 = make_stack(
                count,
                first,
                2 * intermediate_size,
                hidden_size,
                parts=2,
                bias=bias,
                quant_method=method,
            )
            self.w2 = make_stack(
                count,
                first,
                hidden_size,
                intermediate_size,
                parts=1,
                bias=bias,
                quant_method=method,
            )
        self.method = method
        self.quant_method = _HostPostProcess(method, self.mode, self.device)
        for device_stack, host_stack in ((experts.w13, self.w13), (experts.w2, self.w2)):
            _route_host_experts(device_stack, host_stack, first)

    def compute(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This set's experts (ids local to it, -1 for none) on whatever device x is."""
        return _run_experts(self, self.method, x, topk_weights, topk_ids)

    def split_forward(
        self,
        experts: MoEExperts,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The layer's routed output for local ids `topk_ids` (-1: not this rank's)."""
        ids_host = topk_ids.to("cpu")
        host_ids = torch.where(ids_host >= self.first_local, ids_host - self.first_local, -1)
        rows = torch.nonzero((host_ids >= 0).any(1)).squeeze(1)
        x_rows = w_rows = None
        if self.mode == "cpu" and rows.numel():  # to the host before the device work is queued
            x_rows = hidden.index_select(0, rows.to(hidden.device)).to("cpu")
            w_rows = topk_weights.to("cpu").index_select(0, rows)
        if self.first_local > 0:
            device_ids = torch.where(topk_ids < self.first_local, topk_ids, -1)
            out = experts.run_device(hidden, topk_weights, device_ids)
        else:
            out = torch.zeros_like(hidden)
        if not rows.numel():
            return out
        if x_rows is not None and w_rows is not None:
            tokens, part = self._on_cpu(x_rows, w_rows, host_ids.index_select(0, rows))
            tokens = rows.index_select(0, tokens)
        else:
            tokens, part = rows, self._streamed(hidden, topk_weights, host_ids, rows)
        return out.index_add_(0, tokens.to(out.device), part.to(out.device, out.dtype))

    def _on_cpu(
        self, x: torch.Tensor, topk_weights: torch.Tensor, host_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, their outputs) one expert at a time in ascending order, so that adding them
        in that order repeats the unsplit layer's sum (module rules)."""
        tokens, parts = [], []
        plain = (
            self.method is None
            and self.swiglu is None
            and self.activation == "silu"
            and self.w13.bias is None
            and not self.weight_on_input
        )
        for expert in torch.unique(host_ids[host_ids >= 0]).tolist():
            hit = host_ids == expert
            mine = hit.any(1).nonzero().squeeze(1)
            if plain:  # fused_moe_ref's arithmetic for one expert, without its bookkeeping
                weight = (topk_weights * hit).sum(1).index_select(0, mine)  # one nonzero term
                parts.append(self._plain_expert(expert, x.index_select(0, mine), weight))
            else:
                ids = host_ids.index_select(0, mine)
                parts.append(
                    self.compute(
                        x.index_select(0, mine),
                        topk_weights.index_select(0, mine),
                        torch.where(ids == expert, ids, -1),
                    )
                )
            tokens.append(mine)
        return torch.cat(tokens), torch.cat(parts)

    def _plain_expert(self, expert: int, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """weight * W2 silu_and_mul(W13 rows) of one float expert, rounded once to rows' dtype."""
        gate_up = F.linear(rows, self.w13.weight[expert])
        inter = gate_up.shape[1] // 2
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(hidden, self.w2.weight[expert]).float() * weight[:, None].float()
        return y.to(rows.dtype)

    def _streamed(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        host_ids: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """Copy this step's used experts to the device and run them there."""
        used = torch.unique(host_ids[host_ids >= 0])
        remap = torch.full((self.count + 1,), -1, dtype=host_ids.dtype)
        remap[used] = torch.arange(used.numel(), dtype=host_ids.dtype)
        staged_ids = remap[host_ids.index_select(0, rows)]  # -1 stays -1 (remap[-1])
        staged = _Staged(self, used.tolist(), hidden.device)
        dev_rows = rows.to(hidden.device)
        return staged.compute(
            hidden.index_select(0, dev_rows),
            topk_weights.index_select(0, dev_rows),
            staged_ids.to(hidden.device),
        )


class _Staged(nn.Module):
    """A step's copies of some host experts on the device, shaped like their host set."""

    def __init__(self, host: HostExperts, used: list[int], device: torch.device) -> None:
        super().__init__()
        self.swiglu, self.weight_on_input, self.method = (
            host.swiglu,
            host.weight_on_input,
            host.method,
        )
        self.activation = host.activation
        self.w13 = _staged_stack(host.w13, used, device)
        self.w2 = _staged_stack(host.w2, used, device)

    def compute(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return _run_experts(self, self.method, x, topk_weights, topk_ids)


def _run_experts(
    holder: nn.Module,
    method: ExpertQuantMethod | None,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """An expert set shaped like MoEExperts (w13, w2, swiglu, weight_on_input, activation) on
    x's device."""
    if method is not None:
        return method.apply(holder, x, topk_weights, topk_ids)
    w13, w2 = cast(nn.Module, holder.w13), cast(nn.Module, holder.w2)
    return kernels.fused_moe(
        x,
        cast(torch.Tensor, w13.weight),
        cast(torch.Tensor, w2.weight),
        topk_weights,
        topk_ids,
        cast(torch.Tensor | None, w13.bias),
        cast(torch.Tensor | None, w2.bias),
        cast(Any, holder.swiglu),
        bool(holder.weight_on_input),
        str(holder.activation),
    )


def _staged_stack(stack: nn.Module, used: list[int], device: torch.device) -> nn.Module:
    staged = nn.Module()
    tensors = stack_tensors(stack)
    if "bias" not in tensors:
        staged.bias = None  # type: ignore[assignment]
    for name, t in tensors.items():
        buf = torch.empty((len(used), *t.shape[1:]), dtype=t.dtype, device=device)
        for i, e in enumerate(used):  # pinned host slices: asynchronous copies
            buf[i].copy_(t[e], non_blocking=True)
        staged.register_buffer(name, buf, persistent=False)
    return staged


def _route_host_experts(
    device_stack: ExpertStack, host_stack: ExpertStack, first_host: int
) -> None:
    """Checkpoint tensors arrive at the device stack's parameters (their names); those of
    experts >= first_host go on to the host stack's same-named parameter. The host
    parameters are loaded through their device twins (`loaded_through`, weights.py)."""
    host_params = dict(host_stack.named_parameters(recurse=False))
    for name, param in device_stack.named_parameters(recurse=False):
        twin = host_params[name]
        twin.loaded_through = param  # type: ignore[attr-defined]

        def load(p: nn.Parameter, loaded: torch.Tensor, shard_id: str, twin: Any = twin) -> None:
            if int(shard_id.split(":")[0]) >= first_host:
                host_stack.weight_loader(twin, loaded, shard_id)
            else:
                device_stack.weight_loader(p, loaded, shard_id)

        param.weight_loader = load  # type: ignore[attr-defined]
