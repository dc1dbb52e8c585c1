"""Rotary position embedding: builds the cos/sin cache once, applies it through the kernels API.

Supported `rope_scaling` types (HF names, key "rope_type" or legacy "type"): default, linear,
llama3, and "freq_factors" (per-frequency divisors, as GGUF files store for llama 3.1 in the
`rope_freqs` tensor). Anything else is rejected at construction with the supported list.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def compute_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """Rotates q [T, Hq, D] and k [T, Hk, D] by `positions`; the first `rotary_dim` dims turn."""

    cos_sin_cache: torch.Tensor

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, is_neox: bool = True) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim, self.is_neox = head_dim, rotary_dim, is_neox
        inv_freq = compute_inv_freq(rotary_dim, base, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox)
        return q, k
