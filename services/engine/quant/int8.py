"""CPU-friendly int8 weight-only quantization with one float scale per output channel.

Weights load as floats (same path as unquantized) and are quantized in `process_after_loading`:
scale = max|W[n, :]| / 127, W_int8 = round(W / scale). The matmul uses
`aten._weight_int8pack_mm`, which on CPU is fast only for bf16 activations, so activations are
cast to bf16 around the matmul and the result is cast back to the model dtype. Memory traffic per
decode step drops 4x against fp32, which is what bounds batch-1 decode on a small CPU. Other
devices fall back to a dequantizing matmul (correct, not fast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.services.engine.quant.base import (
    QuantConfig,
    QuantMethod,
    UnquantizedLinearMethod,
    layer_tensor,
    linear_2d,
)

_MATMUL_DTYPE = torch.bfloat16


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel; returns (int8 [N, K], float32 scales [N])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8WeightOnlyMethod(QuantMethod):
    """int8 weights, per-channel scales; float activations."""

    def process_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_per_channel(layer_tensor(layer, "weight").detach())
        del layer.weight  # a tied embedding keeps its own reference to the float tensor
        layer.register_buffer("weight_int8", q.contiguous(), persistent=False)
        layer.register_buffer("weight_scale", scale.to(_MATMUL_DTYPE), persistent=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight, scale = layer_tensor(layer, "weight_int8"), layer_tensor(layer, "weight_scale")

        def matmul(x2: torch.Tensor) -> torch.Tensor:
            x2 = x2.to(_MATMUL_DTYPE)
            if x2.device.type == "cpu":
                return torch.ops.aten._weight_int8pack_mm(x2, weight, scale).to(x.dtype)
            return (F.linear(x2, weight.to(x2.dtype)) * scale).to(x.dtype)

        return linear_2d(x, matmul, bias)


class Int8WeightOnlyConfig(QuantConfig):
    """int8 weight-only for every linear layer and the LM head; embeddings stay float."""

    name = "int8"

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return Int8WeightOnlyMethod()


__all__ = ["Int8WeightOnlyConfig", "Int8WeightOnlyMethod", "UnquantizedLinearMethod",
           "quantize_per_channel"]
