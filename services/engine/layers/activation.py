"""Gated activations over the kernels API."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class SiluAndMul(nn.Module):
    """[T, 2I] -> silu(x[:, :I]) * x[:, I:]  (the SwiGLU gate of llama-family MLPs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)


_ACTIVATIONS = {"silu": SiluAndMul}


def get_gated_activation(name: str) -> nn.Module:
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unsupported gated activation {name!r}; supported: "
                         f"{', '.join(sorted(_ACTIVATIONS))}") from None
