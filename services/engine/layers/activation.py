"""Gated activations [T, 2I] -> act(x[:, :I]) * x[:, I:] (gate first, as HF's gate_up order).

Names are HF `hidden_act` / `hidden_activation` values. SiLU runs through the kernels API; the
GELU variants are plain torch (one fused elementwise op either way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flotilla import kernels
from flotilla.kernels.selection import Selecting
from flotilla.services.engine.layers.linear import LinearBase


class SiluAndMul(nn.Module, Selecting):
    """[T, 2I] -> silu(x[:, :I]) * x[:, I:]  (the SwiGLU gate of llama-family MLPs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x, selection=self.selection)


class GeluAndMul(nn.Module):
    """[T, 2I] -> gelu(x[:, :I]) * x[:, I:]; approximate "tanh" for gelu_pytorch_tanh (Gemma)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": GeluAndMul,
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_tanh": lambda: GeluAndMul("tanh"),
}


def gated_projection(gate_up: nn.Module, act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """act(gate_up(x)) for a gated MLP's fused [gate; up] projection. SiLU on a bias-free
    projection goes through its quant method's `apply_gated`, which may store the activation
    from the matmul itself (the decode GEMVs do)."""
    if isinstance(act, SiluAndMul) and isinstance(gate_up, LinearBase) and gate_up.bias is None:
        return gate_up.quant_method.apply_gated(gate_up, x)
    return act(gate_up(x))


def get_gated_activation(name: str) -> nn.Module:
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unsupported gated activation {name!r}; supported: "
                         f"{', '.join(sorted(_ACTIVATIONS))}") from None
