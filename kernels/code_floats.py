"""Small integer codes -> float32 with one instruction each, for the quantized GEMV/GEMM loops.

A code byte b (< 128) put into byte 2 of 0.5f (0x3F000000: exponent byte 0x3F, the byte lands in
mantissa bits 16..22) is the float 0.5 + b / 256 exactly, so one PRMT turns a byte of an int32
word into a float, with no int-to-float conversion (a quarter-rate instruction that would bound
a 4-bit decode GEMV on sm_90). Kernels remove the affine offset once per group:
sum(b * x) = 256 * sum(f * x) - 128 * sum(x). On CUDA `codes4` runs the PRMTs as inline PTX;
under the Triton interpreter (no inline asm) `half_plus` computes the same bits
(tests/kernels/test_inline_asm.py ties the two with a PTX emulator).
"""

from __future__ import annotations

import os

from flotilla.kernels.triton_compat import tl, triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

CODES_ASM = tl.constexpr("""
{
.reg .b32 mg;
mov.b32 mg, 0x3F000000;
prmt.b32 $0, $4, mg, 0x7044;
prmt.b32 $1, $4, mg, 0x7144;
prmt.b32 $2, $4, mg, 0x7244;
prmt.b32 $3, $4, mg, 0x7344;
}
""")


@triton.jit
def half_plus(v, j: tl.constexpr):
    """Byte j of each word as float32 0.5 + byte / 256 (the interpreter's form of the asm)."""
    return ((((v >> (8 * j)) & 255) << 16) | 0x3F000000).to(tl.float32, bitcast=True)


@triton.jit
def codes4(v, USE_ASM: tl.constexpr):
    """int32 words of four code bytes (each < 128) -> 4 tensors, byte j as 0.5 + byte / 256."""
    if USE_ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            CODES_ASM, "=r,=r,=r,=r,r", [v], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    else:
        c0, c1, c2, c3 = half_plus(v, 0), half_plus(v, 1), half_plus(v, 2), half_plus(v, 3)
    return c0, c1, c2, c3


@triton.jit
def bf16_pair(w):
    """int32 holding two bf16 -> (low, high) as float32: a shift and a mask, no conversion."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
