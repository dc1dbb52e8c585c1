"""The inline-PTX blocks of the kernels give the same bits as their interpreter forms (the
CPU tests run the interpreter forms; this ties the asm to them without a GPU)."""

from __future__ import annotations

import numpy as np

from kernels import w4a16
from tests.kernels.ptx_emulator import run_ptx


def test_ptx_emulator_prmt_and_lop3() -> None:
    a = np.array([0x44332211], dtype=np.uint32)
    b = np.array([0x88776655], dtype=np.uint32)
    assert run_ptx("prmt.b32 $0, $1, $2, 0x5410;", {1: a, 2: b})[0][0] == 0x66552211
    assert run_ptx("prmt.b32 $0, $1, $2, 0x7632;", {1: a, 2: b})[0][0] == 0x88774433
    # lop3 0xEA = (a & b) | c
    out = run_ptx("lop3.b32 $0, $1, 0x0F0F0F0F, 0x30000000, 0xEA;", {1: a})[0][0]
    assert out == (0x44332211 & 0x0F0F0F0F) | 0x30000000


def test_w4a16_nibble_asm_matches_interpreter_form() -> None:
    rng = np.random.default_rng(0)
    q = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    q[:3] = [0, 0xFFFFFFFF, 0x76543210]
    out = run_ptx(w4a16._NIBBLES_ASM.value, {8: q})
    for j in range(8):
        code = (q >> np.uint32(4 * j)) & np.uint32(15)
        expected = 0.5 + code.astype(np.float64) / 256  # _half_plus
        got = out[j].view(np.float32).astype(np.float64)
        np.testing.assert_array_equal(got, expected)


def test_kquant_code_asm_matches_interpreter_form() -> None:
    """kernels/gguf_kquant_gemv.py: four code bytes (< 128: 4-bit codes, or 5-bit with Q5_K's
    fifth bit) of a word -> 0.5 + byte / 256, as its _half_plus."""
    from kernels import gguf_kquant_gemv

    rng = np.random.default_rng(1)
    v = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32) & np.uint32(
        0x1F1F1F1F)
    v[:3] = [0, 0x1F1F1F1F, 0x1F100F01]
    out = run_ptx(gguf_kquant_gemv._CODES_ASM.value, {4: v})
    for j in range(4):
        code = (v >> np.uint32(8 * j)) & np.uint32(255)
        got = out[j].view(np.float32).astype(np.float64)
        np.testing.assert_array_equal(got, 0.5 + code.astype(np.float64) / 256)


def test_w4a16_gemv_pair_asm_matches_interpreter_form() -> None:
    """kernels/w4a16_gemv.py: a word -> four packed 16-bit pairs (OFFSET + code i,
    OFFSET + code i + 4), i = 0..3, in fp16 (OFFSET 1024) and bf16 (128): the values of
    _pair_plain, element 0 in the low half."""
    import torch

    from kernels import w4a16_gemv

    rng = np.random.default_rng(2)
    q = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    q[:3] = [0, 0xFFFFFFFF, 0x76543210]
    for asm, offset, dtype in ((w4a16_gemv._PAIRS_ASM_F16, 1024.0, torch.float16),
                               (w4a16_gemv._PAIRS_ASM_BF16, 128.0, torch.bfloat16)):
        out = run_ptx(asm.value, {4: q, 5: q})
        assert sorted(out) == [0, 1, 2, 3]
        for i in range(4):
            halves = torch.from_numpy(out[i].view(np.int16).copy()).view(dtype).double()
            for e in range(2):
                code = (q >> np.uint32(4 * i + 16 * e)) & np.uint32(15)
                np.testing.assert_array_equal(halves[e::2].numpy(), code + offset)
