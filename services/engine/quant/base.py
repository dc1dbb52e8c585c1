"""Per-layer quantization strategy: how a linear layer stores, loads and applies its weight.

Rules:
- A layer owns one `QuantMethod`, chosen by a `QuantConfig` when the layer is built; model code
  never branches on the quantization scheme.
- `create_weights` registers the layer's parameters. The layer (not the method) then attaches a
  `weight_loader` to each parameter, because only the layer knows how checkpoint tensors map onto
  its tensor-parallel shard and its fused (q/k/v, gate/up) sub-blocks.
- `load` copies one checkpoint tensor, already narrowed to the destination's shard, into the
  destination view of a parameter.
- `process_after_loading` runs once after every weight is loaded (repack, quantize, drop the
  float copy). After it, `apply` is the only way the layer's weight is used.
- `apply(layer, x, bias)` computes `x @ W.T (+ bias)` in `x.dtype`.
- Quantized formats (GGUF blocks, GPTQ/AWQ int4, fp8) keep their packed weights and run Triton
  kernels when the weights live on CUDA; elsewhere they dequantize once after loading and serve
  float weights. `FLOTILLA_QUANT_KERNELS=triton` forces the kernels (on CPU: the Triton
  interpreter, for tests), `=torch` forces the dequantized path.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


class QuantMethod(ABC):
    """Storage and matmul strategy of one linear-like layer (see the module rules)."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        """Register `weight` [output_size, input_size] (this rank's shard) on `layer`."""
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                    requires_grad=False)

    def load(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(src.shape)} does not match "
                             f"parameter shard {tuple(dst.shape)}")
        dst.copy_(src)

    def process_after_loading(self, layer: nn.Module) -> None:
        return None

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class UnquantizedLinearMethod(QuantMethod):
    """Plain float weight in the model dtype."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, layer_tensor(layer, "weight"), bias)


class QuantConfig(ABC):
    """Chooses the `QuantMethod` of each layer; `prefix` is the layer's dotted module name."""

    name: str = "none"

    @abstractmethod
    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod: ...


class UnquantizedConfig(QuantConfig):
    name = "none"

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return UnquantizedLinearMethod()


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """A parameter or buffer of `layer`, typed as a tensor."""
    return cast(torch.Tensor, getattr(layer, name))


def use_kernels(device: torch.device) -> bool:
    """Whether quantized layers on `device` run their Triton kernels (see the module rules)."""
    mode = os.environ.get("FLOTILLA_QUANT_KERNELS", "auto").lower()
    if mode not in ("auto", "triton", "torch"):
        raise ValueError(f"FLOTILLA_QUANT_KERNELS must be auto, triton or torch, got {mode!r}")
    return mode == "triton" or (mode == "auto" and device.type == "cuda")


def linear_2d(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
              bias: torch.Tensor | None) -> torch.Tensor:
    """fn(x as [M, K]) -> [M, N], reshaped back to x's leading dims, plus the bias."""
    y = fn(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias


def get_quant_method(config: QuantConfig | None, layer: nn.Module, prefix: str) -> QuantMethod:
    return (config or UnquantizedConfig()).get_method(layer, prefix)
