"""Float weights -> GGUF block bytes, in torch (runs where the weights are: a GPU quantizes 8B
weights in seconds).

Rules:
- Output layouts are exactly the ones `gguf.quants.dequantize` reads (kernels/gguf_dequant.py
  documents them); the tests decode our bytes with gguf.quants.
- The legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) reproduce `gguf.quants.quantize` bit for bit
  (same float32 operation order); tests compare the bytes.
- The k-quants (Q2_K .. Q6_K), which gguf.quants cannot quantize, use round-to-nearest with
  per-sub-block scales (and mins) quantized against fp16 super-block scales. llama.cpp searches
  scales to minimise the error; that is a quality refinement, not a layout difference.
"""

from __future__ import annotations

import torch

from flotilla.kernels.gguf_dequant import (
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    gguf_type,
)

_U8 = torch.uint8


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [nb] or [nb, 1] -> [nb, 2] bytes of its fp16 value."""
    return v.reshape(-1, 1).to(torch.float16).view(_U8)


def _inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, 1.0, d))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[nb, 32] codes -> [nb, 16]: weight i in the low nibble of byte i, i + 16 in the high."""
    return (q[:, :16] & 15) | (q[:, 16:] << 4)


def _pack_bits32(bits: torch.Tensor) -> torch.Tensor:
    """[nb, 32] bits -> [nb, 4] bytes of a little-endian u32 (bit i = weight i)."""
    weights = (1 << torch.arange(8, device=bits.device, dtype=torch.int32))
    return (bits.reshape(-1, 4, 8).to(torch.int32) * weights).sum(-1).to(_U8)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as gguf.quants.np_roundf."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude along the last dim, with its sign (first one on ties)."""
    return torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))


LEGACY_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)  # the 32-weight types this module writes


def _legacy(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    if qtype == Q8_0:
        d = blocks.abs().amax(-1, keepdim=True) / 127
        qs = _roundf(blocks * _inv(d)).to(torch.int8).view(_U8)
        return torch.cat([_f16_bytes(d), qs], dim=-1)
    five = qtype in (Q5_0, Q5_1)
    if qtype in (Q4_0, Q5_0):
        d = _signed_absmax(blocks) / (-16.0 if five else -8.0)
        q = torch.trunc(blocks * _inv(d) + (16.5 if five else 8.5))
        head = [_f16_bytes(d)]
    else:
        mx, mn = blocks.amax(-1, keepdim=True), blocks.amin(-1, keepdim=True)
        d = (mx - mn) / (31.0 if five else 15.0)
        q = torch.trunc((blocks - mn) * _inv(d) + 0.5)
        head = [_f16_bytes(d), _f16_bytes(mn)]
    q = q.clamp(0, 31 if five else 15).to(_U8)  # trunc of a value >= 0.5: never negative
    if five:
        head.append(_pack_bits32(q >> 4))
    return torch.cat([*head, _pack_nibbles(q)], dim=-1)


def _scaled_codes(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, lo: int, hi: int
                  ) -> torch.Tensor:
    """round((x + offset) / scale) clamped to [lo, hi]; 0 where the scale is 0."""
    q = torch.round((x + offset[..., None]) * _inv(scale)[..., None])
    return q.clamp(lo, hi).to(torch.int32)


def _super_scale(v: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block values v [nb, S] >= 0 -> (fp16-rounded super scale [nb], codes [nb, S])
    with v ~ super * code, code in [0, top]."""
    d = (v.amax(-1) / top).to(torch.float16).float()
    codes = torch.round(v * _inv(d)[:, None]).clamp(0, top)
    return d, codes


def _k_minmax(x: torch.Tensor, nmax: int, scale_top: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric k-quant: x [nb, S, L] -> (d, dmin, sc, m, q) with w = d*sc*q - dmin*m."""
    mn = x.amin(-1).clamp(max=0)
    scale = (x.amax(-1) - mn) / nmax
    d, sc = _super_scale(scale, scale_top)
    dmin, m = _super_scale(-mn, scale_top)
    q = _scaled_codes(x, d[:, None] * sc, dmin[:, None] * m, 0, nmax)
    return d, dmin, sc.to(torch.int32), m.to(torch.int32), q


def _k_symmetric(x: torch.Tensor, qmin: int, scale_top: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric k-quant: x [nb, S, L] -> (d, sc signed, q) with w = d*sc*q, q in [qmin, -qmin-1];
    the largest-magnitude element of each sub-block maps to qmin (as Q4_0 does)."""
    s = _signed_absmax(x).squeeze(-1) / qmin
    d = (s.abs().amax(-1) / scale_top).to(torch.float16).float()
    sc = torch.round(s * _inv(d)[:, None]).clamp(-scale_top, scale_top)
    q = _scaled_codes(x, d[:, None] * sc, torch.zeros_like(sc), qmin, -qmin - 1)
    return d, sc.to(torch.int32), q


def _planes(q: torch.Tensor, bits: int, shift: int, planes: int) -> torch.Tensor:
    """q [nb, planes, L] -> [nb, L] bytes: ((q >> shift) & mask) of plane p at bit p * bits."""
    mask = (1 << bits) - 1
    out = torch.zeros_like(q[:, 0])
    for p in range(planes):
        out |= ((q[:, p] >> shift) & mask) << (p * bits)
    return out.to(_U8)


def _k_scales12(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins -> the 12-byte Q4_K/Q5_K packing."""
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return torch.cat([lo, mid, hi], dim=-1).to(_U8)


def _kquant(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    nb = blocks.shape[0]
    if qtype in (Q4_K, Q5_K):
        five = qtype == Q5_K
        d, dmin, sc, m, q = _k_minmax(blocks.reshape(nb, 8, 32), 31 if five else 15, 63)
        qs = torch.cat([_planes(q[:, 2 * p:2 * p + 2], 4, 0, 2) for p in range(4)], dim=-1)
        parts = [_f16_bytes(d), _f16_bytes(dmin), _k_scales12(sc, m)]
        if five:
            parts.append(_planes(q, 1, 4, 8))
        return torch.cat([*parts, qs], dim=-1)
    if qtype == Q2_K:
        d, dmin, sc, m, q = _k_minmax(blocks.reshape(nb, 16, 16), 3, 15)
        q = q.reshape(nb, 2, 4, 32)
        qs = torch.cat([_planes(q[:, n], 2, 0, 4) for n in range(2)], dim=-1)
        return torch.cat([(sc | (m << 4)).to(_U8), qs, _f16_bytes(d), _f16_bytes(dmin)], dim=-1)
    if qtype == Q3_K:
        d, sc, q = _k_symmetric(blocks.reshape(nb, 16, 16), -4, 31)
        code = (q + 4).reshape(nb, 8, 32)  # weight 32i + l
        hmask = _planes(code, 1, 2, 8)
        ql = code.reshape(nb, 2, 4, 32)
        qs = torch.cat([_planes(ql[:, n], 2, 0, 4) for n in range(2)], dim=-1)
        u = sc + 32
        low = (u[:, :8] & 15) | ((u[:, 8:] & 15) << 4)
        high = _planes((u >> 4).reshape(nb, 4, 4), 2, 0, 4)
        return torch.cat([hmask, qs, low.to(_U8), high, _f16_bytes(d)], dim=-1)
    if qtype == Q6_K:
        d, sc, q = _k_symmetric(blocks.reshape(nb, 16, 16), -32, 127)
        code = (q + 32).reshape(nb, 2, 2, 64)  # [half, which 64, i]
        ql = torch.cat([_planes(code[:, n], 4, 0, 2) for n in range(2)], dim=-1)
        quarters = code.reshape(nb, 2, 4, 32)
        qh = torch.cat([_planes(quarters[:, n], 2, 4, 4) for n in range(2)], dim=-1)
        scales = sc.to(torch.int8).view(_U8)
        return torch.cat([ql, qh, scales, _f16_bytes(d)], dim=-1)
    raise ValueError(f"no quantizer for ggml type {qtype}")


def quantize_gguf(weight: torch.Tensor, qtype: int, rows_per_chunk: int = 2048) -> torch.Tensor:
    """Float [N, K] (K a multiple of the block size) -> uint8 [N, K // qk * type_size] blocks,
    computed on the weight's device in float32, a chunk of rows at a time."""
    t = gguf_type(qtype)
    n, k = weight.shape
    if k % t.qk:
        raise ValueError(f"{t.name} needs in_features divisible by {t.qk}, got {k}")
    out = torch.empty(n, k // t.qk * t.type_size, dtype=_U8, device=weight.device)
    legacy = qtype in LEGACY_TYPES
    if not legacy and qtype not in (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K):
        raise ValueError(f"no quantizer for ggml type {t.name} (they are read, not written)")
    for r in range(0, n, rows_per_chunk):
        rows = weight[r:r + rows_per_chunk].float()
        blocks = rows.reshape(-1, t.qk)
        packed = _legacy(blocks, qtype) if legacy else _kquant(blocks, qtype)
        out[r:r + rows_per_chunk] = packed.reshape(rows.shape[0], -1)
    return out


__all__ = ["LEGACY_TYPES", "quantize_gguf"]
