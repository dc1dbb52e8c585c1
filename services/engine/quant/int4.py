"""CPU int4 weight-only quantization: groups of 32 inputs, one scale and one offset per group.

Weights load as floats (the unquantized path) and are quantized in `process_after_loading`, per
output row and group of 32 inputs: scale = (max - min) / 15, q = round((w - min) / scale) in
[0, 15], w ~ q * scale + min. That is GGUF Q4_1's grid, so a Q4_1 file's weights (dequantized by
the loader) come back exactly, up to the bf16 rounding of scale and offset. The matmul is
`aten._weight_int4pack_mm_for_cpu` on bf16 activations (its fast path); batch-1 decode reads
half the bytes of int8. Rules:
- The LM head, and any layer whose input size is not a multiple of 32, stay int8 per channel
  (quant/int8.py): the head is a tenth of a small model's weights and sets every logit.
- Other devices fall back to a dequantizing matmul (correct, not fast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.services.engine.quant.base import (
    ExpertQuantMethod,
    QuantConfig,
    QuantMethod,
    layer_tensor,
    linear_2d,
)
from flotilla.services.engine.quant.int8 import Int8WeightOnlyMethod

GROUP_SIZE = 32
_MATMUL_DTYPE = torch.bfloat16


def quantize_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of W [N, K] -> (q int32 [N, K] in [0, 15], scale and offset
    float32 [N, K / group_size]) with W ~ q * scale + offset."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo


class Int4WeightOnlyMethod(QuantMethod):
    """Packed int4 weights with bf16 [K / 32, N, 2] (scale, zero) pairs; float activations."""

    def process_after_loading(self, layer: nn.Module) -> None:
        q, scale, offset = quantize_groups(layer_tensor(layer, "weight").detach())
        del layer.weight
        # The packed op dequantizes (q - 8) * scale + zero: zero = offset + 8 * scale.
        scale_zero = torch.stack((scale, offset + 8 * scale), -1).transpose(0, 1)
        if q.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        else:
            packed = q.to(torch.uint8)
        layer.register_buffer("weight_int4", packed, persistent=False)
        layer.register_buffer("weight_scale_zero", scale_zero.to(_MATMUL_DTYPE).contiguous(),
                              persistent=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed = layer_tensor(layer, "weight_int4")
        scale_zero = layer_tensor(layer, "weight_scale_zero")

        def matmul(x2: torch.Tensor) -> torch.Tensor:
            x2 = x2.to(_MATMUL_DTYPE)
            if x2.device.type == "cpu":
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, GROUP_SIZE, scale_zero)
            else:
                sz = scale_zero.transpose(0, 1).repeat_interleave(GROUP_SIZE, 1)  # [N, K, 2]
                y = F.linear(x2, (packed.to(x2.dtype) - 8) * sz[..., 0] + sz[..., 1])
            return y.to(x.dtype)

        return linear_2d(x, matmul, bias)


class Int4WeightOnlyConfig(QuantConfig):
    """int4 groups for the linear layers and MoE experts (quant/int4_experts.py); int8 per
    channel for the LM head; embeddings float."""

    name = "int4"

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        input_size = getattr(layer, "input_size", None)
        if prefix == "lm_head" or not isinstance(input_size, int) or input_size % GROUP_SIZE:
            return Int8WeightOnlyMethod()
        return Int4WeightOnlyMethod()

    def get_expert_method(self, prefix: str) -> ExpertQuantMethod | None:
        from flotilla.services.engine.quant.int4_experts import (
            Int4ExpertMethod,  # imports this module
        )

        return Int4ExpertMethod()


__all__ = ["GROUP_SIZE", "Int4WeightOnlyConfig", "Int4WeightOnlyMethod", "quantize_groups"]
