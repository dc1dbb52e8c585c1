"""RoPE frequency schedules: HF `rope_type` -> inverse frequencies and the cos/sin table.

Each scaling type (HF names; key "rope_type" or legacy "type") maps to a function
`(rotary_dim, base, scaling, max_position) -> (inv_freq [rotary_dim / 2], attention_factor)`;
the attention factor multiplies cos and sin (YaRN's mscale, LongRoPE's sqrt(1 + log s / log L)),
exactly as transformers' `ROPE_INIT_FUNCTIONS` do. "freq_factors" holds per-frequency divisors
(how GGUF stores llama-3 scaling, in its `rope_freqs` tensor); "proportional" (Gemma 4) keeps its
`partial_rotary_factor`, the share of the head's frequencies that turn.

LongRoPE (phi3; legacy name "su") has two schedules: short factors for sequences of at most
`original_max_position_embeddings` tokens, long factors for every token of a longer sequence.
`cos_sin_cache` stacks both tables ([short; long], 2 * max_position rows) and the rotary picks
the long half per sequence (see RotaryEmbedding). transformers' `generate` re-prefills a sequence
whose length crosses the threshold while decoding so its earlier keys turn long as well; a paged
engine keeps those cached keys (rotated short), so only that crossing differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

Scaling = dict[str, Any]
InvFreqFn = Callable[[int, float, Scaling, int], tuple[torch.Tensor, float]]


def rope_type(scaling: Scaling | None) -> str:
    if not scaling:
        return "default"
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    return "longrope" if kind == "su" else kind


def base_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _default(dim: int, base: float, scaling: Scaling, max_pos: int) -> tuple[torch.Tensor, float]:
    return base_inv_freq(dim, base), 1.0


def _linear(dim: int, base: float, scaling: Scaling, max_pos: int) -> tuple[torch.Tensor, float]:
    return base_inv_freq(dim, base) / float(scaling["factor"]), 1.0


def _freq_factors(dim: int, base: float, scaling: Scaling, max_pos: int
                  ) -> tuple[torch.Tensor, float]:
    factors = torch.tensor(scaling["factors"], dtype=torch.float32)
    return base_inv_freq(dim, base) / factors, 1.0


def _llama3(dim: int, base: float, scaling: Scaling, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq = base_inv_freq(dim, base)
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _original_max(scaling: Scaling, max_pos: int) -> int:
    return int(scaling.get("original_max_position_embeddings") or max_pos)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, scaling: Scaling, max_pos: int) -> tuple[torch.Tensor, float]:
    old_len = _original_max(scaling, max_pos)
    factor = float(scaling.get("factor") or max_pos / old_len)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = base_inv_freq(dim, base)
    interpolation = extrapolation / factor
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    return inv_freq, float(attention_factor)


def _proportional(dim: int, base: float, scaling: Scaling, max_pos: int
                  ) -> tuple[torch.Tensor, float]:
    """Gemma 4's global layers: the first `partial_rotary_factor` of the head's frequency pairs
    turn at base^(-2j / head_dim) (the exponent over the whole head, unlike a partial rotary), the
    others not at all (frequency 0); all divided by `factor`."""
    angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
    turning = 1.0 / base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim)
    inv_freq = torch.cat([turning, torch.zeros(dim // 2 - angles)])
    return inv_freq / float(scaling.get("factor", 1.0)), 1.0


def _longrope_attention_factor(scaling: Scaling, max_pos: int) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = _original_max(scaling, max_pos)
    factor = float(scaling.get("factor") or max_pos / old_len)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def _longrope(dim: int, base: float, scaling: Scaling, max_pos: int
              ) -> tuple[torch.Tensor, float]:
    """The short schedule (positions below the original length); see cos_sin_cache."""
    factors = torch.tensor(scaling["short_factor"], dtype=torch.float32)
    return base_inv_freq(dim, base) / factors, _longrope_attention_factor(scaling, max_pos)


ROPE_SCALINGS: dict[str, InvFreqFn] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
    "freq_factors": _freq_factors,
    "proportional": _proportional,
}


def inv_freq_and_attention_factor(rotary_dim: int, base: float, scaling: Scaling | None,
                                  max_position: int) -> tuple[torch.Tensor, float]:
    kind = rope_type(scaling)
    try:
        fn = ROPE_SCALINGS[kind]
    except KeyError:
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: "
                         f"{', '.join(ROPE_SCALINGS)}") from None
    return fn(rotary_dim, base, scaling or {}, max_position)


def _table(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float
           ) -> torch.Tensor:
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor


def cos_sin_cache(rotary_dim: int, base: float, scaling: Scaling | None, max_position: int
                  ) -> torch.Tensor:
    """float32 [max_position, rotary_dim]: cos in the first half of each row, sin in the second
    (LongRoPE: [2 * max_position, rotary_dim], the short table then the long one)."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(rotary_dim, base, scaling,
                                                               max_position)
    positions = torch.arange(max_position, dtype=torch.float32)
    cache = _table(positions, inv_freq, attention_factor)
    if rope_type(scaling) == "longrope":
        assert scaling is not None
        long_inv = base_inv_freq(rotary_dim, base) / torch.tensor(scaling["long_factor"],
                                                                 dtype=torch.float32)
        cache = torch.cat((cache, _table(positions, long_inv, attention_factor)))
    return cache.to(torch.float32)


def longrope_threshold(scaling: Scaling | None, max_position: int) -> int | None:
    """Sequences longer than this use LongRoPE's long table; None for other rope types."""
    if rope_type(scaling) != "longrope":
        return None
    assert scaling is not None
    return _original_max(scaling, max_position)
