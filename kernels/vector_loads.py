"""16-byte vector loads and 16-bit activation pairs for the decode GEMVs of packed weights.

Triton lays a tile out by its loads' contiguity: a GEMV whose weight rows are contiguous gets
lanes along the rows and moves x through shared memory. The k-quant and 4-bit GEMVs instead put
the lanes along K and load each thread's 16 bytes with one inline-PTX `ld.global.nc.v4`
(`load16`), so x is loaded and converted once per thread for all of its rows and nothing crosses
threads before the end. Under the interpreter (USE_ASM=False) the same words come from plain
loads.
"""

from __future__ import annotations

from flotilla.kernels.code_floats import bf16_pair
from flotilla.kernels.triton_compat import tl, triton

_LOAD16_ASM = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")
_LOAD_F32_ASM = tl.constexpr("ld.global.nc.f32 $0, [$1];")
_LOAD_F16_ASM = tl.constexpr("ld.global.nc.b16 $0, [$1];")
_LOAD_U8_ASM = tl.constexpr("ld.global.nc.u8 $0, [$1];")


@triton.jit
def load16(ptr, USE_ASM: tl.constexpr):
    """The four int32 words at each (16-byte aligned, in-bounds) address."""
    if USE_ASM:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            _LOAD16_ASM, "=r,=r,=r,=r,l", [ptr.to(tl.int64, bitcast=True)],
            dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        w0, w1, w2, w3 = tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)
    return w0, w1, w2, w3


@triton.jit
def load_scalars(ptr, USE_ASM: tl.constexpr):
    """The fp32 / fp16 / uint8 value at each address, as float32. On CUDA through inline PTX: a
    tl.load of addresses with no contiguous axis (per-row scales) makes Triton lay the whole
    tile out with lanes along rows (x through shared memory again: 5.1 instead of 3.3 SASS
    instructions per 4-bit weight)."""
    if USE_ASM:
        addr = ptr.to(tl.int64, bitcast=True)
        if ptr.dtype.element_ty == tl.float32:
            v = tl.inline_asm_elementwise(_LOAD_F32_ASM, "=r,l", [addr], dtype=tl.float32,
                                          is_pure=True, pack=1)
        elif ptr.dtype.element_ty == tl.float16:
            v = tl.inline_asm_elementwise(_LOAD_F16_ASM, "=h,l", [addr], dtype=tl.int16,
                                          is_pure=True, pack=1).to(tl.float16, bitcast=True)
        else:
            tl.static_assert(ptr.dtype.element_ty == tl.uint8, "fp32, fp16 or uint8 values")
            v = tl.inline_asm_elementwise(_LOAD_U8_ASM, "=r,l", [addr], dtype=tl.int32,
                                          is_pure=True, pack=1)
        return v.to(tl.float32)
    return tl.load(ptr).to(tl.float32)


@triton.jit
def load_run(rows, r, USE_ASM: tl.constexpr):
    """The 8 int32 words (32 bytes, two 16-byte loads) of run r of each row: words 8r .. 8r + 7
    from the int32 row pointers `rows`."""
    w0, w1, w2, w3 = load16(rows + r * 8, USE_ASM)
    w4, w5, w6, w7 = load16(rows + r * 8 + 4, USE_ASM)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def f16_low(w):
    """The f16 in the low half of each int32 as float32."""
    return w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_pair(w):
    """int32 holding two f16 -> (low, high) as float32."""
    return f16_low(w), f16_low(w >> 16)


@triton.jit
def x8(x_row, off, X_WORDS: tl.constexpr, USE_ASM: tl.constexpr):
    """x[2 * off + i], i = 0..7, as float32 (off: offset in 16-bit pairs, a multiple of 4).
    X_WORDS: x is bf16 / f16 with 16-byte aligned rows, read as one vector of int32 pairs."""
    if X_WORDS:
        w0, w1, w2, w3 = load16(x_row.to(tl.pointer_type(tl.int32), bitcast=True) + off,
                                USE_ASM)
        if x_row.dtype.element_ty == tl.float16:
            x0, x1 = _f16_pair(w0)
            x2, x3 = _f16_pair(w1)
            x4, x5 = _f16_pair(w2)
            x6, x7 = _f16_pair(w3)
        else:
            x0, x1 = bf16_pair(w0)
            x2, x3 = bf16_pair(w1)
            x4, x5 = bf16_pair(w2)
            x6, x7 = bf16_pair(w3)
    else:
        k = x_row + 2 * off
        x0, x1 = tl.load(k).to(tl.float32), tl.load(k + 1).to(tl.float32)
        x2, x3 = tl.load(k + 2).to(tl.float32), tl.load(k + 3).to(tl.float32)
        x4, x5 = tl.load(k + 4).to(tl.float32), tl.load(k + 5).to(tl.float32)
        x6, x7 = tl.load(k + 6).to(tl.float32), tl.load(k + 7).to(tl.float32)
    return x0, x1, x2, x3, x4, x5, x6, x7


def x_words_ok(x) -> bool:  # type: ignore[no-untyped-def]
    """x [M, K] (torch) can be read as 16-byte vectors of 16-bit pairs."""
    import torch

    return bool(x.dtype in (torch.bfloat16, torch.float16) and x.data_ptr() % 16 == 0
                and (x.shape[0] == 1 or x.stride(0) % 8 == 0) and x.stride(-1) == 1)


__all__ = ["f16_low", "load16", "load_run", "load_scalars", "x8", "x_words_ok"]
