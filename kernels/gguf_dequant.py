"""GGUF (ggml) quantized block formats: the type table, a torch dequantizer, Triton group decoders.

A quantized GGUF matrix [N, K] is stored as it is in the file: uint8 [N, K // QK * TYPE_SIZE],
each row a run of blocks of QK weights (32 for the legacy types, 256 for the k-quants). Layouts
follow the `gguf` package's reference `dequantize` (gguf.quants), which the tests compare against:

    Q4_0  d f16 | qs[16]                      w = d * (q4 - 8)
    Q4_1  d f16 | m f16 | qs[16]              w = d * q4 + m
    Q5_0  d f16 | qh u32 | qs[16]             w = d * (q5 - 16)
    Q5_1  d f16 | m f16 | qh u32 | qs[16]     w = d * q5 + m
    Q8_0  d f16 | qs int8[32]                 w = d * q8
    Q2_K  scales[16] | qs[64] | d | dmin      w = d * sc4 * q2 - dmin * m4        (16-weight groups)
    Q3_K  hmask[32] | qs[64] | scales[12] | d w = d * (sc6 - 32) * (q3 - 4)       (16-weight groups)
    Q4_K  d | dmin | scales[12] | qs[128]     w = d * sc6 * q4 - dmin * m6        (32-weight groups)
    Q5_K  d | dmin | scales[12] | qh[32] | qs[128]   as Q4_K with a fifth bit
    Q6_K  ql[128] | qh[64] | scales int8[16] | d     w = d * sc8 * (q6 - 32)      (16-weight groups)
    IQ4_NL  d f16 | qs[16]                           w = d * K[q4]     (K: a 16-value int8 grid)
    IQ4_XS  d f16 | scales_h u16 | scales_l[4] | qs[128]   w = d * (sc6 - 32) * K[q4]
            (32-weight groups; sub-block j: qs[16j..16j+15], sc6 = nibble j of scales_l |
            bits 2j..2j+1 of scales_h << 4)

The grid types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: kernels/gguf_iq.py.
The IQ4 grid K (llama.cpp's kvalues_iq4nl) is read from gguf.quants at import, not copied; the
Triton decoder looks it up in two 64-bit constants of eight biased bytes each.

The Triton side decodes one 32-weight group `g` of a block at a time (`dequant_group`), which is
what both matmul kernels (kernels/gguf_matmul.py) iterate over. Every type size is even, so the f16
fields are read through an f16 view of the same bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL

from flotilla.kernels.gguf_iq import (
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ_GRID_TYPES,
    dequant_iq_group,
    dequantize_iq_ref,
)
from flotilla.kernels.triton_compat import tl, triton


class GGUFType(NamedTuple):
    name: str
    qk: int  # weights per block
    type_size: int  # bytes per block


# ggml type ids (gguf.GGMLQuantizationType values) of the types the kernels decode.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23
GGUF_TYPES: dict[int, GGUFType] = {
    Q4_0: GGUFType("Q4_0", 32, 18), Q4_1: GGUFType("Q4_1", 32, 20),
    Q5_0: GGUFType("Q5_0", 32, 22), Q5_1: GGUFType("Q5_1", 32, 24),
    Q8_0: GGUFType("Q8_0", 32, 34), Q2_K: GGUFType("Q2_K", 256, 84),
    Q3_K: GGUFType("Q3_K", 256, 110), Q4_K: GGUFType("Q4_K", 256, 144),
    Q5_K: GGUFType("Q5_K", 256, 176), Q6_K: GGUFType("Q6_K", 256, 210),
    IQ4_NL: GGUFType("IQ4_NL", 32, 18), IQ4_XS: GGUFType("IQ4_XS", 256, 136),
    IQ2_XXS: GGUFType("IQ2_XXS", 256, 66), IQ2_XS: GGUFType("IQ2_XS", 256, 74),
    IQ2_S: GGUFType("IQ2_S", 256, 82), IQ3_XXS: GGUFType("IQ3_XXS", 256, 98),
    IQ3_S: GGUFType("IQ3_S", 256, 110),
}
IQ4_GRID: tuple[int, ...] = tuple(int(v) for v in _GGUF_IQ4_NL.kvalues)  # 16 int8 values


def _packed_grid(values: tuple[int, ...]) -> int:
    """Eight int8 values as the bytes (value + 128) of a signed 64-bit integer."""
    word = sum((v + 128) << (8 * i) for i, v in enumerate(values))
    return word - (1 << 64) if word >= 1 << 63 else word


_IQ4_LO = tl.constexpr(_packed_grid(IQ4_GRID[:8]))
_IQ4_HI = tl.constexpr(_packed_grid(IQ4_GRID[8:]))


def gguf_type(qtype: int) -> GGUFType:
    try:
        return GGUF_TYPES[int(qtype)]
    except KeyError:
        raise ValueError(f"ggml type {qtype} has no quantized kernel; supported: "
                         f"{', '.join(t.name for t in GGUF_TYPES.values())}") from None


def gguf_in_features(qweight: torch.Tensor, qtype: int) -> int:
    """K of a [N, row_bytes] block matrix."""
    t = gguf_type(qtype)
    if qweight.shape[-1] % t.type_size:
        raise ValueError(f"{t.name} rows must be a multiple of {t.type_size} bytes, got "
                         f"{qweight.shape[-1]}")
    return qweight.shape[-1] // t.type_size * t.qk


# ---------------------------------------------------------------- torch reference dequantizer


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> float32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 16] bytes -> [nb, 32]: low nibbles are weights 0..15, high nibbles 16..31."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[nb, 4] bytes of a little-endian u32 -> [nb, 32] bits, bit i = weight i."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], 32)


def _shifted(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """b [nb, G, L] -> [nb, G, len(shifts), L] of (b >> s) & mask."""
    s = torch.tensor(shifts, device=b.device, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return (b[:, :, None, :] >> s) & mask


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, [nb, 8] each."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def _dequant_blocks(b: torch.Tensor, qtype: int) -> torch.Tensor:
    """Blocks [nb, type_size] uint8 -> weights [nb, qk] float32."""
    nb = b.shape[0]
    if qtype == Q4_0:
        return _half(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8)
    if qtype == Q4_1:
        return _half(b[:, :2]) * _nibbles(b[:, 4:]).float() + _half(b[:, 2:4])
    if qtype == Q5_0:
        q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
        return _half(b[:, :2]) * (q.float() - 16)
    if qtype == Q5_1:
        q = _nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
        return _half(b[:, :2]) * q.float() + _half(b[:, 2:4])
    if qtype == Q8_0:
        return _half(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()
    if qtype == Q2_K:
        sc, qs, d, dmin = b[:, :16], b[:, 16:80], _half(b[:, 80:82]), _half(b[:, 82:84])
        q = _shifted(qs.reshape(nb, 2, 32), [0, 2, 4, 6], 3).reshape(nb, 16, 16).float()
        dl = (d * (sc & 15).float())[:, :, None]
        ml = (dmin * (sc >> 4).float())[:, :, None]
        return (dl * q - ml).reshape(nb, 256)
    if qtype == Q3_K:
        hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _half(b[:, 108:110])
        low = _shifted(scales[:, None, :8], [0, 4], 15).reshape(nb, 16)
        high = _shifted(scales[:, None, 8:12], [0, 2, 4, 6], 3).reshape(nb, 16)
        sc = ((low | (high << 4)).float() - 32)[:, :, None]
        ql = _shifted(qs.reshape(nb, 2, 32), [0, 2, 4, 6], 3).reshape(nb, 16, 16)
        qh = _shifted(hmask[:, None, :], list(range(8)), 1).reshape(nb, 16, 16)
        q = ql.float() - 4 * (1 - qh.float())
        return (d[:, :, None] * sc * q).reshape(nb, 256)
    if qtype in (Q4_K, Q5_K):
        d, dmin = _half(b[:, :2]), _half(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        qs = b[:, 16:144] if qtype == Q4_K else b[:, 48:176]
        q = _shifted(qs.reshape(nb, 4, 32), [0, 4], 15).reshape(nb, 8, 32)
        if qtype == Q5_K:
            qh = _shifted(b[:, None, 16:48], list(range(8)), 1).reshape(nb, 8, 32)
            q = q | (qh << 4)
        return ((d * sc)[:, :, None] * q.float() - (dmin * mn)[:, :, None]).reshape(nb, 256)
    if qtype in IQ_GRID_TYPES:
        return dequantize_iq_ref(b, qtype)
    if qtype == IQ4_NL:
        grid = torch.tensor(IQ4_GRID, dtype=torch.float32, device=b.device)
        return _half(b[:, :2]) * grid[_nibbles(b[:, 2:]).long()]
    if qtype == IQ4_XS:
        grid = torch.tensor(IQ4_GRID, dtype=torch.float32, device=b.device)
        low = _shifted(b[:, None, 4:8], [0, 4], 15).permute(0, 3, 2, 1).reshape(nb, 8)
        high = _shifted(b[:, None, 2:4], [0, 2, 4, 6], 3).permute(0, 3, 2, 1).reshape(nb, 8)
        sc = (low | (high << 4)).float() - 32
        q = _nibbles(b[:, 8:].reshape(nb * 8, 16)).reshape(nb, 8, 32)
        return (_half(b[:, :2]) * sc)[:, :, None].mul(grid[q.long()]).reshape(nb, 256)
    if qtype == Q6_K:
        ql, qh, d = b[:, :128], b[:, 128:192], _half(b[:, 208:210])
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        lo = _shifted(ql.reshape(nb, 2, 64), [0, 4], 15).reshape(nb, 2, 4, 32)
        hi = _shifted(qh.reshape(nb, 2, 32), [0, 2, 4, 6], 3)
        q = ((lo | (hi << 4)).float() - 32).reshape(nb, 16, 16)
        return ((d * sc)[:, :, None] * q).reshape(nb, 256)
    raise ValueError(f"no dequantizer for ggml type {qtype}")


def dequantize_ref(qweight: torch.Tensor, qtype: int, rows_per_chunk: int = 4096
                   ) -> torch.Tensor:
    """[N, row_bytes] uint8 blocks -> float32 [N, K], on the tensor's device."""
    t = gguf_type(qtype)
    n, k = qweight.shape[0], gguf_in_features(qweight, qtype)
    out = torch.empty(n, k, dtype=torch.float32, device=qweight.device)
    for r in range(0, n, rows_per_chunk):
        rows = qweight[r:r + rows_per_chunk].contiguous()
        blocks = rows.reshape(-1, t.type_size)
        out[r:r + rows_per_chunk] = _dequant_blocks(blocks, int(qtype)).reshape(rows.shape[0], k)
    return out


# ---------------------------------------------------------------- Triton group decoders


@triton.jit
def _u8(ptr, off, mask):
    """Bytes at ptr + off as int32 (0 where masked)."""
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr16, off, mask):
    """The f16 at byte offset `off` (even) as float32 (0 where masked)."""
    return tl.load(ptr16 + off // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _kscale(ptr, b, mask, j: tl.constexpr, MIN: tl.constexpr):
    """Q4_K/Q5_K 6-bit scale (MIN=False) or min (MIN=True) of sub-block j; b = block offsets."""
    if j < 4:
        v = _u8(ptr, b + 4 + j + (4 if MIN else 0), mask) & 63
    else:
        packed = _u8(ptr, b + 4 + j + 4, mask)
        top = _u8(ptr, b + j + (4 if MIN else 0), mask) >> 6
        low = (packed >> 4) if MIN else (packed & 15)
        v = low | (top << 4)
    return v.to(tl.float32)


@triton.jit
def _q3_scale(ptr, b, mask, s: tl.constexpr):
    """Q3_K signed 6-bit scale of 16-weight sub-block s (scales start at byte 96)."""
    low = (_u8(ptr, b + 96 + (s % 8), mask) >> (4 * (s // 8))) & 15
    high = (_u8(ptr, b + 104 + (s % 4), mask) >> (2 * (s // 4))) & 3
    return ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _i8(ptr, off, mask):
    v = _u8(ptr, off, mask)
    return v - ((v >> 7) << 8)


@triton.jit
def _iq4_value(q):
    """IQ4 codes (int32 in [0, 16)) -> their grid values as float32."""
    word = tl.where(q < 8, _IQ4_LO, _IQ4_HI)
    return (((word >> (8 * (q & 7)).to(tl.int64)) & 255) - 128).to(tl.float32)


@triton.jit
def dequant_group(
    u8_ptr,  # the block bytes
    f16_ptr,  # the same bytes viewed as f16 (all block sizes and f16 fields are 2-aligned)
    grid_ptr,  # float32 grid of the IQ2_* / IQ3_* types (kernels/gguf_iq.py iq_grid)
    blk,  # int64 [A, B]: byte offset of the block each (a, b) reads
    mask,  # bool [A, B]: False -> the group decodes to zeros
    g: tl.constexpr,  # which 32-weight group of the block (0 for the 32-weight types)
    QTYPE: tl.constexpr,
):
    """Weights g*32 .. g*32+31 of each block, float32 [A, B, 32], in natural order."""
    b = tl.expand_dims(blk, 2)
    m = tl.expand_dims(mask, 2)
    l = tl.arange(0, 32)[None, None, :]
    if QTYPE == 2:  # Q4_0
        q = (_u8(u8_ptr, b + 2 + l % 16, m) >> (4 * (l // 16))) & 15
        w = tl.expand_dims(_f16(f16_ptr, blk, mask), 2) * (q - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1
        q = (_u8(u8_ptr, b + 4 + l % 16, m) >> (4 * (l // 16))) & 15
        d = tl.expand_dims(_f16(f16_ptr, blk, mask), 2)
        w = d * q.to(tl.float32) + tl.expand_dims(_f16(f16_ptr, blk + 2, mask), 2)
    elif QTYPE == 6:  # Q5_0
        q = (_u8(u8_ptr, b + 6 + l % 16, m) >> (4 * (l // 16))) & 15
        q = q | (((_u8(u8_ptr, b + 2 + l // 8, m) >> (l % 8)) & 1) << 4)
        w = tl.expand_dims(_f16(f16_ptr, blk, mask), 2) * (q - 16).to(tl.float32)
    elif QTYPE == 7:  # Q5_1
        q = (_u8(u8_ptr, b + 8 + l % 16, m) >> (4 * (l // 16))) & 15
        q = q | (((_u8(u8_ptr, b + 4 + l // 8, m) >> (l % 8)) & 1) << 4)
        d = tl.expand_dims(_f16(f16_ptr, blk, mask), 2)
        w = d * q.to(tl.float32) + tl.expand_dims(_f16(f16_ptr, blk + 2, mask), 2)
    elif QTYPE == 8:  # Q8_0
        q = _i8(u8_ptr, b + 2 + l, m)
        w = tl.expand_dims(_f16(f16_ptr, blk, mask), 2) * q.to(tl.float32)
    elif QTYPE == 10:  # Q2_K: group g = half g // 4, 2-bit plane g % 4
        q = (_u8(u8_ptr, b + 16 + 32 * (g // 4) + l, m) >> (2 * (g % 4))) & 3
        sc_a = _u8(u8_ptr, blk + 2 * g, mask)
        sc_b = _u8(u8_ptr, blk + 2 * g + 1, mask)
        d = _f16(f16_ptr, blk + 80, mask)
        dmin = _f16(f16_ptr, blk + 82, mask)
        dl = tl.where(l < 16, tl.expand_dims(d * (sc_a & 15).to(tl.float32), 2),
                      tl.expand_dims(d * (sc_b & 15).to(tl.float32), 2))
        ml = tl.where(l < 16, tl.expand_dims(dmin * (sc_a >> 4).to(tl.float32), 2),
                      tl.expand_dims(dmin * (sc_b >> 4).to(tl.float32), 2))
        w = dl * q.to(tl.float32) - ml
    elif QTYPE == 11:  # Q3_K
        ql = (_u8(u8_ptr, b + 32 + 32 * (g // 4) + l, m) >> (2 * (g % 4))) & 3
        hbit = (_u8(u8_ptr, b + l, m) >> g) & 1
        q = ql - 4 + 4 * hbit
        d = _f16(f16_ptr, blk + 108, mask)
        dl = tl.where(l < 16, tl.expand_dims(d * _q3_scale(u8_ptr, blk, mask, 2 * g), 2),
                      tl.expand_dims(d * _q3_scale(u8_ptr, blk, mask, 2 * g + 1), 2))
        w = dl * q.to(tl.float32)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: group g = byte run g // 2, nibble g % 2
        QS: tl.constexpr = 16 if QTYPE == 12 else 48
        q = (_u8(u8_ptr, b + QS + 32 * (g // 2) + l, m) >> (4 * (g % 2))) & 15
        if QTYPE == 13:
            q = q | (((_u8(u8_ptr, b + 16 + l, m) >> g) & 1) << 4)
        scale = _f16(f16_ptr, blk, mask) * _kscale(u8_ptr, blk, mask, g, False)
        mn = _f16(f16_ptr, blk + 2, mask) * _kscale(u8_ptr, blk, mask, g, True)
        w = tl.expand_dims(scale, 2) * q.to(tl.float32) - tl.expand_dims(mn, 2)
    elif QTYPE == 16 or QTYPE == 17 or QTYPE == 18 or QTYPE == 21 or QTYPE == 22:
        w = dequant_iq_group(u8_ptr, f16_ptr, grid_ptr, blk, mask, g, QTYPE)
    elif QTYPE == 20:  # IQ4_NL
        q = (_u8(u8_ptr, b + 2 + l % 16, m) >> (4 * (l // 16))) & 15
        w = tl.expand_dims(_f16(f16_ptr, blk, mask), 2) * _iq4_value(q)
    elif QTYPE == 23:  # IQ4_XS: group g = sub-block g
        q = (_u8(u8_ptr, b + 8 + 16 * g + l % 16, m) >> (4 * (l // 16))) & 15
        low = (_u8(u8_ptr, blk + 4 + g // 2, mask) >> (4 * (g % 2))) & 15
        high = (_u8(u8_ptr, blk + 2 + g // 4, mask) >> (2 * (g % 4))) & 3
        dl = _f16(f16_ptr, blk, mask) * ((low | (high << 4)) - 32).to(tl.float32)
        w = tl.expand_dims(dl, 2) * _iq4_value(q)
    else:  # Q6_K: group g = half g // 4, quarter j = g % 4 of it
        n: tl.constexpr = g // 4
        j: tl.constexpr = g % 4
        ql = (_u8(u8_ptr, b + 64 * n + 32 * (j % 2) + l, m) >> (4 * (j // 2))) & 15
        qh = (_u8(u8_ptr, b + 128 + 32 * n + l, m) >> (2 * j)) & 3
        q = (ql | (qh << 4)) - 32
        d = _f16(f16_ptr, blk + 208, mask)
        dl = tl.where(l < 16, tl.expand_dims(d * _i8(u8_ptr, blk + 192 + 2 * g, mask).to(
            tl.float32), 2), tl.expand_dims(d * _i8(u8_ptr, blk + 193 + 2 * g, mask).to(
                tl.float32), 2))
        w = dl * q.to(tl.float32)
    return w
