"""A tiny PTX interpreter for the integer inline-asm blocks of our kernels (the Triton
interpreter cannot run inline asm, so without this the asm would first run on a GPU).

Supports the instructions those blocks use, on uint32 numpy arrays: mov, and, or, xor, shl,
shr, prmt (default mode), lop3, add, and the packed-half subtractions sub.rn.bf16x2 /
sub.rn.f16x2 (round to nearest even, finite values). Operands: `$N` (Triton's numbered
operands), declared `.reg` names, and integer immediates.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

U32 = np.uint32


def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """Default-mode prmt: bytes of {b, a} numbered 0-7 (a = 0-3); selector nibble i picks
    result byte i (bit 3 of a nibble replicates the sign bit: not used by our blocks)."""
    src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint64)
    for i in range(4):
        nib = (sel.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(7)
        if np.any((sel.astype(np.uint64) >> np.uint64(4 * i + 3)) & np.uint64(1)):
            raise NotImplementedError("prmt sign replication")
        byte = (src >> (nib * np.uint64(8))) & np.uint64(0xFF)
        out |= byte << np.uint64(8 * i)
    return out.astype(U32)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a)
    lut_i = int(lut.flat[0])
    for bit in range(8):  # minterm (a, b, c) = bit 2, 1, 0 of the index; 0xF0/0xCC/0xAA
        if lut_i >> bit & 1:
            ta = a if bit & 4 else ~a
            tb = b if bit & 2 else ~b
            tc = c if bit & 1 else ~c
            out |= ta & tb & tc
    return out


def _halves(v: np.ndarray, bf16: bool) -> tuple[np.ndarray, np.ndarray]:
    """The two 16-bit floats of each word (low, high) as float64."""
    def one(h: np.ndarray) -> np.ndarray:
        if bf16:
            return (h.astype(U32) << U32(16)).view(np.float32).astype(np.float64)
        return h.astype(np.uint16).view(np.float16).astype(np.float64)
    return one(v & U32(0xFFFF)), one(v >> U32(16))


def _to_half_bits(f: np.ndarray, bf16: bool) -> np.ndarray:
    if bf16:  # float32 bits rounded to nearest even in the top 16
        b = f.astype(np.float32).view(U32).astype(np.uint64)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(U32)
    return f.astype(np.float16).view(np.uint16).astype(U32)


def _sub_x2(bf16: bool) -> Callable[..., Any]:
    def sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        (al, ah), (bl, bh) = _halves(a, bf16), _halves(b, bf16)
        return _to_half_bits(al - bl, bf16) | (_to_half_bits(ah - bh, bf16) << U32(16))
    return sub


OPS: dict[str, Callable[..., Any]] = {
    "mov": lambda a: a,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "shl": lambda a, b: (a.astype(np.uint64) << b.astype(np.uint64)).astype(U32),
    "shr": lambda a, b: a >> b,
    "add": lambda a, b: (a.astype(np.uint64) + b).astype(U32),
    "prmt": _prmt,
    "lop3": _lop3,
    "sub.rn.bf16x2": _sub_x2(bf16=True),
    "sub.rn.f16x2": _sub_x2(bf16=False),
}


def run_ptx(asm: str, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Execute `asm` with input operands {N: uint32 array}; returns every `$N` it writes."""
    regs: dict[str, np.ndarray] = {f"${n}": v.astype(U32) for n, v in operands.items()}
    written: dict[int, np.ndarray] = {}
    shape = next(iter(operands.values())).shape

    def value(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return np.full(shape, int(tok, 0) & 0xFFFFFFFF, dtype=U32)
        raise KeyError(f"unknown operand {tok!r}")

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, _, args = line.partition(" ")
        name = op.split(".")[0]
        dst, *srcs = [a.strip() for a in args.split(",")]
        regs[dst] = OPS[op if op in OPS else name](*(value(s) for s in srcs))
        if dst.startswith("$"):
            written[int(dst[1:])] = regs[dst]
    return written
