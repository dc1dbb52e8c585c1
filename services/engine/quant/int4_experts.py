"""int4 MoE experts (`--quantization int4`, the CPU default for Q4_1 GGUFs): the int4 groups of
quant/int4.py applied to each expert of a stack.

Rules:
- Experts load as floats [E, out, in] and are quantized per expert in `process_after_loading`:
  groups of 32 inputs, one scale and one offset each (quant/int4.py `quantize_groups`).
- On the CPU each stack keeps `weight_int4` uint8 [E, out, in / 2] (torch's CPU int4 pack, one
  per expert) and `weight_scale_zero` bf16 [E, in / 32, out, 2]; `apply` runs each routed
  expert's two matmuls through `aten._weight_int4pack_mm_for_cpu` on bf16 rows and sums the
  weighted outputs in fp32 in ascending expert order (as kernels/fused_moe.py's reference).
  That is the host format of offloaded experts too (layers/moe_offload.py).
- Elsewhere (no int4 MoE kernel on the GPU) the stacks dequantize once to the model dtype and
  run the float fused MoE. A stack whose input size is not a multiple of 32 stays float.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from flotilla import kernels
from flotilla.kernels.activation import swiglu_oai_ref
from flotilla.services.engine.quant.base import ExpertQuantMethod, layer_tensor
from flotilla.services.engine.quant.int4 import GROUP_SIZE, quantize_groups

if TYPE_CHECKING:
    from flotilla.services.engine.layers.moe import MoEExperts

_MATMUL_DTYPE = torch.bfloat16


class Int4ExpertMethod(ExpertQuantMethod):
    takes_input_weight = True

    def __init__(self) -> None:
        self.dtype = torch.get_default_dtype()  # the model's: models are built under it

    def create_weights(self, stack: nn.Module, num_local: int, out_size: int, in_size: int) -> None:
        stack.weight = nn.Parameter(torch.empty(num_local, out_size, in_size), requires_grad=False)

    def process_after_loading(self, experts: nn.Module) -> None:
        moe = cast("MoEExperts", experts)
        for stack in (moe.w13, moe.w2):
            weight = layer_tensor(stack, "weight").data
            num, out, inp = weight.shape
            if inp % GROUP_SIZE:
                continue
            q, scale, offset = quantize_groups(weight.reshape(num * out, inp))
            q, scale, offset = (t.unflatten(0, (num, out)) for t in (q, scale, offset))
            del stack.weight
            if weight.device.type != "cpu":
                dense = (
                    q.float().unflatten(-1, (-1, GROUP_SIZE)) * scale[..., None] + offset[..., None]
                )
                stack.register_buffer("weight", dense.flatten(-2).to(self.dtype), persistent=False)
                continue
            # the packed op dequantizes (q - 8) * scale + zero: zero = offset + 8 * scale
            packed = [
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[e], 1) for e in range(num)
            ]
            scale_zero = torch.stack((scale, offset + 8 * scale), -1).transpose(1, 2)
            stack.register_buffer(
                "weight_int4",
                torch.stack(packed) if packed else torch.empty(0, out, inp // 2, dtype=torch.uint8),
                persistent=False,
            )
            stack.register_buffer(
                "weight_scale_zero", scale_zero.to(_MATMUL_DTYPE).contiguous(), persistent=False
            )

    def apply(
        self,
        experts: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        moe = cast("MoEExperts", experts)
        w13, w2 = moe.w13, moe.w2
        if not hasattr(w13, "weight_int4") and not hasattr(w2, "weight_int4"):
            return kernels.fused_moe(
                x,
                layer_tensor(w13, "weight"),
                layer_tensor(w2, "weight"),
                topk_weights,
                topk_ids,
                w13.bias,
                w2.bias,
                moe.swiglu,
                moe.weight_on_input,
                selection=self.selection,
            )
        num_experts, top_k = _num_experts(w13), topk_ids.shape[1]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        flat_ids, flat_weights = topk_ids.reshape(-1), topk_weights.reshape(-1)
        valid = (flat_ids >= 0) & (flat_ids < num_experts)
        for expert in torch.unique(flat_ids[valid]).tolist():
            pairs = torch.nonzero(flat_ids == expert).squeeze(1)
            tokens = pairs // top_k
            rows = x.index_select(0, tokens)
            if moe.weight_on_input:
                rows = rows * flat_weights[pairs, None].to(rows.dtype)
            gate_up = _linear(w13, expert, rows)
            if moe.swiglu is None:
                inter = gate_up.shape[1] // 2
                hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            else:
                hidden = swiglu_oai_ref(gate_up, moe.swiglu)
            y = _linear(w2, expert, hidden).float()
            if not moe.weight_on_input:
                y = y * flat_weights[pairs, None].float()
            out.index_add_(0, tokens, y)
        return out.to(x.dtype)


def _num_experts(stack: nn.Module) -> int:
    packed = getattr(stack, "weight_int4", None)
    return int((packed if packed is not None else layer_tensor(stack, "weight")).shape[0])


def _linear(stack: nn.Module, expert: int, rows: torch.Tensor) -> torch.Tensor:
    """rows @ W[expert].T (+ bias[expert]) in rows' dtype, W int4-packed or float."""
    bias = None if stack.bias is None else cast(torch.Tensor, stack.bias)[expert]
    packed = getattr(stack, "weight_int4", None)
    if packed is None:
        return F.linear(rows, layer_tensor(stack, "weight")[expert], bias)
    scale_zero = layer_tensor(stack, "weight_scale_zero")[expert]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        rows.to(_MATMUL_DTYPE), packed[expert], GROUP_SIZE, scale_zero
    ).to(rows.dtype)
    return y if bias is None else y + bias
