"""RMSNorm over the kernels API, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight. With `residual`, first residual += x; returns (y, residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        out, residual = kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return out, residual
