"""GGUF i-quant types that index a grid (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): layouts, the
grids as device tables, and the Triton decoder of one 32-weight group (called by
kernels/gguf_dequant.py's `dequant_group`).

Each 256-weight super-block has an f16 d first; weights come in runs of 8 (IQ2_*) or 4 (IQ3_*)
that are one row of a fixed grid (values 8 / 25 / 43, or 4 .. 62), a sign per weight and a
sub-block scale. Per 32-weight group g (weight l, run j8 = l // 8, k = l % 8):

    IQ2_XXS (66)  qs u32 pairs at 2 + 8g: bytes 0-3 grid rows of runs 0-3; u32 `aux` at 4:
                  scale aux >> 28 (w = d (0.5 + s) / 4), run j8's signs ksigns[(aux >> 7 j8) & 127]
    IQ2_XS (74)   u16 q at 2 + 2 (4g + j8): grid row q & 511, signs ksigns[q >> 9]; scales[8]
                  at 66: nibble j8 // 2 of byte g, w = d (0.5 + s) / 4
    IQ2_S (82)    grid row qs[4g + j8] (byte 2 + ...) | ((qh[g] >> 2 j8) & 3) << 8 (qh at 66);
                  sign byte 34 + 4g + j8; scales at 74 as IQ2_XS
    IQ3_XXS (98)  grid row (of 4) qs[8g + l // 4] at byte 2; u32 aux at 66 + 4g: scale aux >> 28
                  (w = d (0.5 + s) / 2), signs as IQ2_XXS
    IQ3_S (110)   grid row qs[i] | bit i of qh (qh at 66) << 8, i = 8g + l // 4; sign byte
                  74 + 4g + j8; scales[4] at 106: nibble g % 2 of byte g // 2, w = d (1 + 2 s)

ksigns[i] (7 sign bits and an 8th making the parity even) is computed: i | parity(i) << 7 (the
tests check it against gguf.quants' table). The grids are read from gguf.quants at run time
(its `init_grid`), not copied, and kept per device as float32 [rows * run] tables.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from flotilla.kernels.triton_compat import tl, triton

IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S, IQ2_S = 16, 17, 18, 21, 22
IQ_GRID_TYPES = frozenset({IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S, IQ2_S})
_tables: dict[tuple[int, str], torch.Tensor] = {}


def iq_grid(qtype: int, device: torch.device, placeholder: torch.Tensor) -> torch.Tensor:
    """The grid of `qtype` as float32 [rows * run] on `device`, made once per device (the first
    call, a warm-up before any CUDA-graph capture); for types without a grid `placeholder` (the
    kernels take the pointer either way and never read it)."""
    if int(qtype) not in IQ_GRID_TYPES:
        return placeholder
    key = (int(qtype), str(device))
    if key not in _tables:
        import gguf.quants as q

        cls = getattr(q, GGMLQuantizationType(int(qtype)).name)
        cls.init_grid()
        grid = np.ascontiguousarray(cls.grid, dtype=np.float32).reshape(-1)
        _tables[key] = torch.from_numpy(grid).to(device)
    return _tables[key]


def dequantize_iq_ref(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """[nb, type_size] uint8 -> float32 [nb, 256] by gguf.quants (on the host)."""
    out = dequantize(blocks.cpu().numpy(), GGMLQuantizationType(int(qtype)))
    return torch.from_numpy(np.asarray(out, dtype=np.float32)).to(blocks.device)


@triton.jit
def _u8(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _u32(ptr, off, mask):
    """Little-endian u32 at byte offset off (as int32 bits)."""
    return _u8(ptr, off, mask) | (_u8(ptr, off + 1, mask) << 8) | \
        (_u8(ptr, off + 2, mask) << 16) | (_u8(ptr, off + 3, mask) << 24)


@triton.jit
def _ksign(idx, k):
    """Bit k of ksigns[idx]: sign bit k of a 7-bit index with even-parity bit 7 (1 = minus)."""
    p = idx ^ (idx >> 4)
    p = p ^ (p >> 2)
    p = (p ^ (p >> 1)) & 1
    return ((idx | (p << 7)) >> k) & 1


@triton.jit
def dequant_iq_group(u8_ptr, f16_ptr, grid_ptr, blk, mask, g: tl.constexpr,
                     QTYPE: tl.constexpr):
    """Weights g*32 .. g*32+31 of each block, float32 [A, B, 32] (blk, mask: [A, B])."""
    b = tl.expand_dims(blk, 2)
    m = tl.expand_dims(mask, 2)
    l = tl.arange(0, 32)[None, None, :]
    j8 = l // 8
    k = l % 8
    d = tl.load(f16_ptr + blk // 2, mask=mask, other=0.0).to(tl.float32)
    if QTYPE == 16:  # IQ2_XXS
        row = _u8(u8_ptr, b + 2 + 8 * g + j8, m)
        aux = _u32(u8_ptr, blk + 6 + 8 * g, mask)
        dl = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        sign = _ksign((tl.expand_dims(aux, 2) >> (7 * j8)) & 127, k)
        value = tl.load(grid_ptr + row * 8 + k, mask=m, other=0.0)
    elif QTYPE == 17:  # IQ2_XS
        q = _u8(u8_ptr, b + 2 + 2 * (4 * g + j8), m) | (_u8(u8_ptr, b + 3 + 2 * (4 * g + j8), m)
                                                        << 8)
        sc = (_u8(u8_ptr, b + 66 + g, m) >> (4 * (j8 // 2))) & 15
        dl = tl.expand_dims(d, 2) * (0.5 + sc.to(tl.float32)) * 0.25
        sign = _ksign(q >> 9, k)
        value = tl.load(grid_ptr + (q & 511) * 8 + k, mask=m, other=0.0)
    elif QTYPE == 22:  # IQ2_S
        row = _u8(u8_ptr, b + 2 + 4 * g + j8, m) | \
            (((_u8(u8_ptr, b + 66 + g, m) >> (2 * j8)) & 3) << 8)
        sc = (_u8(u8_ptr, b + 74 + g, m) >> (4 * (j8 // 2))) & 15
        dl = tl.expand_dims(d, 2) * (0.5 + sc.to(tl.float32)) * 0.25
        sign = (_u8(u8_ptr, b + 34 + 4 * g + j8, m) >> k) & 1
        value = tl.load(grid_ptr + row * 8 + k, mask=m, other=0.0)
    elif QTYPE == 18:  # IQ3_XXS
        row = _u8(u8_ptr, b + 2 + 8 * g + l // 4, m)
        aux = _u32(u8_ptr, blk + 66 + 4 * g, mask)
        dl = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
        sign = _ksign((tl.expand_dims(aux, 2) >> (7 * j8)) & 127, k)
        value = tl.load(grid_ptr + row * 4 + l % 4, mask=m, other=0.0)
    else:  # IQ3_S
        i = 8 * g + l // 4
        row = _u8(u8_ptr, b + 2 + i, m) | (((_u8(u8_ptr, b + 66 + i // 8, m) >> (i % 8)) & 1)
                                           << 8)
        sc = (_u8(u8_ptr, blk + 106 + g // 2, mask) >> (4 * (g % 2))) & 15
        dl = d * (1 + 2 * sc).to(tl.float32)
        sign = (_u8(u8_ptr, b + 74 + 4 * g + j8, m) >> k) & 1
        value = tl.load(grid_ptr + row * 4 + l % 4, mask=m, other=0.0)
    if QTYPE == 16 or QTYPE == 18 or QTYPE == 21:
        dl = tl.expand_dims(dl, 2)
    return dl * value * (1 - 2 * sign).to(tl.float32)
