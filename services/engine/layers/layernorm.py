"""Normalisation layers, optionally fused with the residual add.

Rules:
- `norm(x)` returns the normalised x; `norm(x, residual)` first forms residual + x and returns
  (normalised sum, sum), so decoder layers carry the residual stream without extra adds.
- GemmaRMSNorm checkpoints store w with the scale applied as (1 + w); its loader stores 1 + w so
  the forward is the plain RMSNorm kernel.
- x is [T, H]; per-head norms (q/k norms) are applied on [T * heads, head_dim] views.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flotilla import kernels
from flotilla.kernels.selection import Selecting


class RMSNorm(nn.Module, Selecting):
    """y = x / rms(x) * weight. With `residual`, first residual += x; returns (y, residual).
    x / rms(x) is rounded to x's dtype before the scale (HF llama's order) unless
    `round_normed` is False (`RMSNormFp32Scale`). Runs under its kernel `selection`."""

    round_normed: ClassVar[bool] = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps, self.round_normed,
                                    selection=self.selection)
        out, residual = kernels.fused_add_rms_norm(x, residual, self.weight, self.eps,
                                                   self.round_normed, selection=self.selection)
        return out, residual


class RMSNormFp32Scale(RMSNorm):
    """HF gpt-oss's RMSNorm: the scale multiplies the fp32 normalised row, rounded once,
    `(weight * x_normed).to(dtype)`."""

    round_normed: ClassVar[bool] = False


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = x / rms(x) * (1 + w), w as stored in the checkpoint."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"norm weight shape {tuple(loaded.shape)} != {tuple(param.shape)}")
        param.data.copy_(loaded.float() + 1.0)


class LayerNorm(nn.Module):
    """y = (x - mean) / std * weight + bias (torch LayerNorm), with the same residual contract."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        residual = x + residual
        return F.layer_norm(residual, self.weight.shape, self.weight, self.bias, self.eps), residual
