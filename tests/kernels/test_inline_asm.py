"""The inline-PTX blocks of the kernels give the same bits as their interpreter forms (the
CPU tests run the interpreter forms; this ties the asm to them without a GPU)."""

from __future__ import annotations

import numpy as np

from flotilla.kernels import code_floats
from tests.kernels.ptx_emulator import run_ptx


def test_ptx_emulator_prmt_and_lop3() -> None:
    a = np.array([0x44332211], dtype=np.uint32)
    b = np.array([0x88776655], dtype=np.uint32)
    assert run_ptx("prmt.b32 $0, $1, $2, 0x5410;", {1: a, 2: b})[0][0] == 0x66552211
    assert run_ptx("prmt.b32 $0, $1, $2, 0x7632;", {1: a, 2: b})[0][0] == 0x88774433
    # lop3 0xEA = (a & b) | c
    out = run_ptx("lop3.b32 $0, $1, 0x0F0F0F0F, 0x30000000, 0xEA;", {1: a})[0][0]
    assert out == (0x44332211 & 0x0F0F0F0F) | 0x30000000


def test_code_byte_asm_matches_interpreter_form() -> None:
    """kernels/code_floats.py: four code bytes (< 128: 4-bit codes, Q5_K's 5-bit codes, 6-bit
    k-quant scales) of a word -> 0.5 + byte / 256, as `half_plus` computes them."""
    rng = np.random.default_rng(1)
    v = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32) & np.uint32(
        0x7F7F7F7F)
    v[:3] = [0, 0x7F7F7F7F, 0x1F100F01]
    out = run_ptx(code_floats.CODES_ASM.value, {4: v})
    assert sorted(out) == [0, 1, 2, 3]
    for j in range(4):
        code = (v >> np.uint32(8 * j)) & np.uint32(255)
        got = out[j].view(np.float32).astype(np.float64)
        np.testing.assert_array_equal(got, 0.5 + code.astype(np.float64) / 256)


def test_w4a16_nibbles_through_code_bytes() -> None:
    """w4a16._codes8's split: the low nibbles of each byte (q & 0x0F0F0F0F) are codes 0, 2, 4,
    6 and the high ones ((q >> 4) & 0x0F0F0F0F, arithmetic shift) codes 1, 3, 5, 7 of a word."""
    rng = np.random.default_rng(0)
    q = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    q[:3] = [0, 0xFFFFFFFF, 0x76543210]
    lo = q & np.uint32(0x0F0F0F0F)
    hi = (q.view(np.int32) >> 4).view(np.uint32) & np.uint32(0x0F0F0F0F)
    out_lo = run_ptx(code_floats.CODES_ASM.value, {4: lo})
    out_hi = run_ptx(code_floats.CODES_ASM.value, {4: hi})
    for j in range(8):
        code = (q >> np.uint32(4 * j)) & np.uint32(15)
        got = (out_lo if j % 2 == 0 else out_hi)[j // 2].view(np.float32).astype(np.float64)
        np.testing.assert_array_equal(got, 0.5 + code.astype(np.float64) / 256)
