"""Rotary position embedding: builds the cos/sin cache once, applies it through the kernels API.

Rules:
- Only the first `rotary_dim` dims of each head turn (partial rotary: stablelm, phi, glm); the
  rest pass through. `is_neox=True` rotates halves (HF llama's rotate_half), False interleaved
  pairs (GPT-J / GLM style).
- Frequency schedules (default, linear, llama3, yarn, longrope, freq_factors) live in
  rope_scaling.py; anything else is rejected at construction with the supported list.
- `get_rope` hands out one module per distinct parameter set and device, so all layers of a
  model share one cos/sin table instead of one per layer.
- LongRoPE (`LongRopeRotaryEmbedding`): every token of a sequence longer than the original
  context reads the long table (rows offset by max_position); sequence lengths come from the
  forward context.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from flotilla import kernels
from flotilla.kernels.selection import DEFAULT_SELECTION, KernelSelection
from flotilla.services.engine.forward_context import get_forward_context
from flotilla.services.engine.layers.rope_scaling import (
    ROPE_SCALINGS,
    cos_sin_cache,
    inv_freq_and_attention_factor,
    longrope_threshold,
    rope_type,
)

SUPPORTED_ROPE_TYPES = tuple(ROPE_SCALINGS)


def compute_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None,
                     max_position: int = 2048) -> torch.Tensor:
    return inv_freq_and_attention_factor(rotary_dim, base, scaling, max_position)[0]


class RotaryEmbedding(nn.Module):
    """Rotates q [T, Hq, D] and k [T, Hk, D] by `positions`; the first `rotary_dim` dims turn."""

    cos_sin_cache: torch.Tensor

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, is_neox: bool = True) -> None:
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim, self.rotary_dim, self.is_neox = head_dim, rotary_dim, is_neox
        self.max_position = max_position
        cache = cos_sin_cache(rotary_dim, base, rope_scaling, max_position)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        selection: KernelSelection = DEFAULT_SELECTION,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`selection`: the calling attention layer's (a table is shared by models, get_rope)."""
        q, k = kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox,
                                        selection=selection)
        return q, k


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """LongRoPE: the table holds [short; long]; tokens of sequences longer than `threshold` read
    the long half. Not a plain table lookup by position, so attention never fuses it."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, is_neox: bool = True) -> None:
        super().__init__(head_dim, rotary_dim, max_position, base, rope_scaling, is_neox)
        threshold = longrope_threshold(rope_scaling, max_position)
        assert threshold is not None
        self.threshold = threshold

    def table_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """positions, offset by max_position for tokens of sequences past the threshold."""
        meta = get_forward_context()
        tokens = torch.arange(positions.shape[0], device=positions.device,
                              dtype=meta.query_start_loc.dtype)
        seq = torch.searchsorted(meta.query_start_loc[1:], tokens, right=True)
        seq = seq.clamp(max=meta.seq_lens.shape[0] - 1)  # CUDA-graph padding rows
        long = (meta.seq_lens[seq] > self.threshold).to(positions.dtype)
        return positions + long * self.max_position

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        selection: KernelSelection = DEFAULT_SELECTION,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(self.table_rows(positions), q, k, selection)


_ROPES: dict[tuple[Any, ...], RotaryEmbedding] = {}


def get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: dict[str, Any] | None = None, is_neox: bool = True) -> RotaryEmbedding:
    """A shared RotaryEmbedding on the current default device (models are built under
    `torch.device(...)`, so the table lands where the model does)."""
    device = torch.get_default_device()
    key = (head_dim, rotary_dim, max_position, base, json.dumps(rope_scaling, sort_keys=True),
           is_neox, str(device))
    rope = _ROPES.get(key)
    if rope is None:
        cls = LongRopeRotaryEmbedding if rope_type(rope_scaling) == "longrope" else \
            RotaryEmbedding
        rope = _ROPES[key] = cls(head_dim, rotary_dim, max_position, base, rope_scaling, is_neox)
    return rope
