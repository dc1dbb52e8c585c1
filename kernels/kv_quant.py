"""FP8 (e4m3) KV cache: one fp32 scale per (token, KV head), computed when the token is written.

Rules:
- An fp8 layer cache is a K and a V tensor float8_e4m3fn [num_blocks, block_size, Hk, D] plus
  `KVScales`: fp32 [num_blocks, block_size, Hk] contiguous for K and for V, so the scale of
  (slot, head) sits at `slot * Hk + head` (slot = block * block_size + offset, as slot_mapping).
- Writing a head row x [D]: scale = amax(|x|) / 448 (1.0 for an all-zero row), stored value =
  e4m3(clamp(x / scale, -448, 448)) rounded to nearest even, x taken in fp32 after rounding to
  the model dtype. Reading: x ~= e4m3 * scale. No calibration; a row's outliers only cost that
  row its precision. The cost is 4 bytes per D-byte row: capacity is 4D / (2D + 8) of bf16's
  (1.94x for D = 128, 1.88x for D = 64).
- Kernels never build a dequantized copy of the cache: the decode (and small prefill) tiles
  multiply the raw scores q.k by the key scales and the softmax weights by the value scales
  (exact algebra: q.(s k) = s (q.k), sum p (s v) = sum (p s) v); the prefill's wgmma tiles scale
  each K / V row in registers as they widen it for the 16-bit dots (attention_tile.attend_tile).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flotilla.kernels.triton_compat import tl, triton

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX: tl.constexpr = tl.constexpr(448.0)


class KVScales(NamedTuple):
    """Dequantization scales of an fp8 KV cache, fp32 [num_blocks, block_size, Hk] each."""

    k: torch.Tensor
    v: torch.Tensor


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor,
                    kv_scales: KVScales | None) -> None:
    """Caches with scales must be e4m3 with matching contiguous fp32 scales; without, not fp8."""
    if kv_scales is None:
        if k_cache.dtype == FP8_KV_DTYPE or v_cache.dtype == FP8_KV_DTYPE:
            raise ValueError("an fp8 KV cache needs its kv_scales")
        return
    if k_cache.dtype != FP8_KV_DTYPE or v_cache.dtype != FP8_KV_DTYPE:
        raise ValueError(f"kv_scales given but the caches are {k_cache.dtype} / {v_cache.dtype}, "
                         f"not {FP8_KV_DTYPE}")
    want = tuple(k_cache.shape[:3])
    for name, s in (("k", kv_scales.k), ("v", kv_scales.v)):
        if tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"kv_scales.{name} must be contiguous float32 {want}, got "
                             f"{s.dtype} {tuple(s.shape)}")
        if s.device != k_cache.device:
            raise ValueError(f"kv_scales.{name} is on {s.device}, the cache on {k_cache.device}")


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 [..., D], fp32 scales [...]) by the rule in the module docstring."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (xf / scale[..., None]).clamp(-448.0, 448.0).to(FP8_KV_DTYPE)
    return q, scale


def dequantize_kv_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [..., D] and fp32 scales [...] -> fp32 [..., D]."""
    return q.float() * scale[..., None]


@triton.jit
def scales_from_amax(amax):
    """Row scales from row amax, as quantize_kv_ref (IEEE division: the GPU rounds as torch)."""
    return tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)),
                    1.0)


@triton.jit
def quantize(x, scale):
    """fp32 x [H, N] / scale [H, 1] -> e4m3, clamped to the finite range."""
    y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    return tl.clamp(y, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


@triton.jit
def quantize_rows(x):
    """fp32 rows [H, D] (masked elements 0) -> (e4m3 [H, D], fp32 scales [H])."""
    scale = scales_from_amax(tl.max(tl.abs(x), 1))
    return quantize(x, scale[:, None]), scale
