"""Decode GEMV for Q4_K / Q5_K blocks: y[m] = x[m] @ W.T with W kept quantized.

Block layout: a Q4_K super-block (144 bytes) holds d and dmin (f16), 12 bytes of 6-bit sub-block
scales and mins, and its 256 codes as four 32-byte runs; run p holds sub-block 2p in its low
nibbles and 2p + 1 in its high ones. Q5_K (176 bytes) has the runs at byte 48 and a 32-byte qh
run at byte 16 whose bit j of byte l is the fifth bit of weight l of sub-block j.

Work split: element (row, block, run p) of a [BLOCK_N, NSB, 4] index space dots one run (8 int32
words, two 16-byte loads) with its 64 x values. The lanes of a warp lie along runs and blocks,
the warps along rows, so a thread holds BLOCK_N * NSB / (8 * warps) rows of one (block, run):
x is loaded and converted once per thread for all of them, and nothing is reduced across
threads before the end. The loads are inline PTX (ld.global.nc.v4): with tl.load, Triton lays
the tile out by the loads' contiguity (lanes along rows) and moves x through shared memory.

A 4-bit GEMV on sm_90 is bound by instruction issue (128 per clock per SM), not bandwidth,
unless it spends about 2-3 instructions per weight. Here (tests/quant/sm90_compile.py counts
them) codes become floats with one PRMT each (a code byte put into byte 2 of 0.5f gives
0.5 + code / 256), x is read as bf16 pairs and converted with a shift or a mask, and the scale
and min of sub-block j apply after its dot:

    sum_l w_l x_l = d * sc_j * (256 * sum_l f_l x_l - 128 * S_j) - dmin * mn_j * S_j

with S_j = sum_l x_l: 3.4-4.4 SASS instructions per Q4_K weight, 4.2-4.9 per Q5_K one over the
autotune configs (the tl.load kernel before: 8.2-12.4 and 10.8-18.9). The interpreter (CPU
tests) runs plain forms of the asm (USE_ASM=False) giving the same bits. The tile is autotuned
per (N, K) and type on CUDA.
"""

from __future__ import annotations

import torch

from flotilla.kernels.code_floats import INTERPRET, codes4
from flotilla.kernels.gemv_rows import gemv_rows, gemv_store, lane_gemv
from flotilla.kernels.gguf_dequant import Q4_K, Q5_K, gguf_type
from flotilla.kernels.pdl import pdl_wait_after
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.tuning import warmup_autotune
from flotilla.kernels.vector_loads import f16_low, load16, x8

_ROTL_ASM = tl.constexpr("shf.l.wrap.b32 $0, $1, $1, $2;")


@triton.jit
def _fifth_bits(qh, p, USE_ASM: tl.constexpr):
    """qh rotated so that bit 2p of each byte lands on bit 4 (bit 2p + 1 on bit 5): one rotate
    on CUDA, its amount fixed per lane."""
    if USE_ASM:
        r = tl.inline_asm_elementwise(_ROTL_ASM, "=r,r,r", [qh, (4 - 2 * p) & 31],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = (qh >> (2 * p)) << 4
    return r


@triton.jit
def _dot_word(d_lo, d_hi, q, qh, p, FIVE_BITS: tl.constexpr, USE_ASM: tl.constexpr,
              l0, l1, l2, l3, h0, h1, h2, h3):
    """Adds one code word of run p: low nibbles times l0..l3 to d_lo, high ones times h0..h3
    to d_hi (codes as 0.5 + code / 256; qh: the word's fifth bits, Q5_K)."""
    lo = q & 0x0F0F0F0F
    hi = (q >> 4) & 0x0F0F0F0F
    if FIVE_BITS:  # bits 2p and 2p + 1 of each qh byte become bit 4 of the code bytes
        r = _fifth_bits(qh, p, USE_ASM)
        lo = lo | (r & 0x10101010)
        hi = hi | ((r >> 1) & 0x10101010)
    a0, a1, a2, a3 = codes4(lo, USE_ASM)
    b0, b1, b2, b3 = codes4(hi, USE_ASM)
    d_lo = d_lo + a0 * l0 + a1 * l1 + a2 * l2 + a3 * l3
    d_hi = d_hi + b0 * h0 + b1 * h1 + b2 * h2 + b3 * h3
    return d_lo, d_hi


@triton.jit
def _scales_mins(a_word, b_word, c_word, p):
    """6-bit scales and mins of sub-blocks 2p and 2p + 1 as float32; a/b/c_word: the 12 scale
    bytes as int32 words (scale j < 4: byte j & 63; min j < 4: byte 4 + j & 63; j >= 4: the low
    / high nibble of byte 4 + j below the top two bits of bytes j - 4 / j)."""
    sh = 16 * (p % 2)
    a = a_word >> sh
    b = b_word >> sh
    c = c_word >> sh
    low = p < 2
    sc = tl.where(low, a & 0x3F3F, (c & 0x0F0F) | ((a >> 2) & 0x3030))
    mn = tl.where(low, b & 0x3F3F, ((c >> 4) & 0x0F0F) | ((b >> 2) & 0x3030))
    return ((sc & 255).to(tl.float32), (sc >> 8).to(tl.float32),
            (mn & 255).to(tl.float32), (mn >> 8).to(tl.float32))


@triton.jit
def _load_step(w_rows, kb, nblocks, blocks, p, TW: tl.constexpr, QS: tl.constexpr,
               FIVE_BITS: tl.constexpr, EVEN: tl.constexpr, USE_ASM: tl.constexpr):
    """The weight words of the loop step at block kb: 8 code words of run p, 8 fifth-bit words
    (Q5_K; else repeats) and the 4 header words (d | dmin, 12 scale bytes)."""
    bidx = kb + blocks
    if not EVEN:
        bidx = tl.minimum(bidx, nblocks - 1)
    blk = w_rows + bidx * TW + p * 0  # [BLOCK_N, NSB, 4]: block start
    q0, q1, q2, q3 = load16(blk + QS + 8 * p, USE_ASM)
    q4, q5, q6, q7 = load16(blk + QS + 8 * p + 4, USE_ASM)
    if FIVE_BITS:
        h0, h1, h2, h3 = load16(blk + 4, USE_ASM)
        h4, h5, h6, h7 = load16(blk + 8, USE_ASM)
    else:
        h0, h1, h2, h3, h4, h5, h6, h7 = q0, q0, q0, q0, q0, q0, q0, q0  # unused
    dd, s0, s1, s2 = load16(blk, USE_ASM)
    return q0, q1, q2, q3, q4, q5, q6, q7, h0, h1, h2, h3, h4, h5, h6, h7, dd, s0, s1, s2


@triton.jit
def _word_pair(d_lo, d_hi, s_lo, s_hi, x_row, xo, qa, ha, qb, hb, p, FIVE_BITS: tl.constexpr,
               X_WORDS: tl.constexpr, USE_ASM: tl.constexpr, FIRST: tl.constexpr = False):
    """Two code words of run p (8 weights of sub-block 2p, 8 of 2p + 1) against their x (bf16
    pairs at xo and xo + 16): the dots and the x sums, accumulated."""
    l0, l1, l2, l3, l4, l5, l6, l7 = x8(x_row, xo, X_WORDS, USE_ASM)
    g0, g1, g2, g3, g4, g5, g6, g7 = x8(x_row, xo + 16, X_WORDS, USE_ASM)
    if FIRST:  # s_lo / s_hi come in unset
        s_lo = ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
        s_hi = ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7))
    else:
        s_lo += ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
        s_hi += ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7))
    d_lo, d_hi = _dot_word(d_lo, d_hi, qa, ha, p, FIVE_BITS, USE_ASM,
                           l0, l1, l2, l3, g0, g1, g2, g3)
    d_lo, d_hi = _dot_word(d_lo, d_hi, qb, hb, p, FIVE_BITS, USE_ASM,
                           l4, l5, l6, l7, g4, g5, g6, g7)
    return d_lo, d_hi, s_lo, s_hi


@triton.jit
def _kquant_gemv_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # uint8 [N, row_bytes] Q4_K / Q5_K blocks, 16-byte aligned rows
    out_ptr,  # [M, N] in x's dtype
    N,
    K,
    stride_xm,
    stride_wn,  # bytes between weight rows
    stride_om,
    FIVE_BITS: tl.constexpr,  # Q5_K
    TYPE_SIZE: tl.constexpr,  # 144 (Q4_K) or 176 (Q5_K)
    GATED: tl.constexpr,  # [gate; up] rows: store silu(gate) * up (kernels/gemv_rows.py)
    USE_ASM: tl.constexpr,  # CUDA: inline PTX loads and code conversion
    X_WORDS: tl.constexpr,  # x is bf16 / f16 with 16-byte aligned rows: read as int32 pairs
    EVEN: tl.constexpr,  # NSB divides K / 256
    BLOCK_N: tl.constexpr,
    NSB: tl.constexpr,  # super-blocks per loop step
    PREFETCH: tl.constexpr,  # load step i + 1 before the arithmetic of step i
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py)
):
    TW: tl.constexpr = TYPE_SIZE // 4  # int32 words per block
    QS: tl.constexpr = 12 if FIVE_BITS else 4  # word offset of the code runs
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    # rows past N read row N - 1 (the asm loads take no mask); their sums are not stored
    w_rows = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) \
        + gemv_rows(pid_n, N, BLOCK_N, GATED)[:, None, None] * (stride_wn // 4)
    x_row = x_ptr + m * stride_xm
    nblocks = K // 256
    blocks = tl.arange(0, NSB)[None, :, None]
    p = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([BLOCK_N, NSB, 4], dtype=tl.float32)
    # step 0's words first: with PDL they load while the previous kernel finishes, and the
    # wait for x (that kernel's output) comes once they are in (kernels/pdl.py)
    w = _load_step(w_rows, 0, nblocks, blocks, p, TW, QS, FIVE_BITS, EVEN, USE_ASM)
    x_row += pdl_wait_after(w[0], USE_PDL)
    for kb in range(0, nblocks, NSB):
        if PREFETCH:  # issue the next step's loads before this step's arithmetic
            if kb + NSB < nblocks:
                w_next = _load_step(w_rows, kb + NSB, nblocks, blocks, p, TW, QS, FIVE_BITS, EVEN,
                                    USE_ASM)
            else:
                w_next = w
        q0, q1, q2, q3, q4, q5, q6, q7, h0, h1, h2, h3, h4, h5, h6, h7, dd, s0, s1, s2 = w
        bidx = kb + blocks
        if not EVEN:
            b_ok = bidx < nblocks
            bidx = tl.minimum(bidx, nblocks - 1)
        # x of run p: sub-block 2p at bf16-pair offset 128 * block + 32 p, 2p + 1 16 pairs on
        xo = bidx * 128 + 32 * p  # [1, NSB, 4]
        d_lo = tl.zeros([BLOCK_N, NSB, 4], dtype=tl.float32)
        d_hi = tl.zeros([BLOCK_N, NSB, 4], dtype=tl.float32)
        d_lo, d_hi, s_lo, s_hi = _word_pair(d_lo, d_hi, 0.0, 0.0, x_row, xo, q0, h0, q1, h1, p,
                                            FIVE_BITS, X_WORDS, USE_ASM, True)
        d_lo, d_hi, s_lo, s_hi = _word_pair(d_lo, d_hi, s_lo, s_hi, x_row, xo + 4, q2, h2, q3,
                                            h3, p, FIVE_BITS, X_WORDS, USE_ASM)
        d_lo, d_hi, s_lo, s_hi = _word_pair(d_lo, d_hi, s_lo, s_hi, x_row, xo + 8, q4, h4, q5,
                                            h5, p, FIVE_BITS, X_WORDS, USE_ASM)
        d_lo, d_hi, s_lo, s_hi = _word_pair(d_lo, d_hi, s_lo, s_hi, x_row, xo + 12, q6, h6, q7,
                                            h7, p, FIVE_BITS, X_WORDS, USE_ASM)
        d = f16_low(dd)
        dmin = f16_low(dd >> 16)
        if not EVEN:
            d = tl.where(b_ok, d, 0.0)
            dmin = tl.where(b_ok, dmin, 0.0)
        sc_lo, sc_hi, mn_lo, mn_hi = _scales_mins(s0, s1, s2, p)
        acc += d * (sc_lo * (256.0 * d_lo - 128.0 * s_lo) + sc_hi * (256.0 * d_hi - 128.0 * s_hi)) \
            - dmin * (mn_lo * s_lo + mn_hi * s_hi)
        if PREFETCH:
            w = w_next
        elif kb + NSB < nblocks:  # the next step's words, after this step's arithmetic
            w = _load_step(w_rows, kb + NSB, nblocks, blocks, p, TW, QS, FIVE_BITS, EVEN, USE_ASM)
    gemv_store(tl.sum(tl.sum(acc, axis=2), axis=1), out_ptr + m * stride_om, pid_n, N, BLOCK_N,
               GATED)


# Tiles tried on the device, keyed on (N, K): (BLOCK_N, NSB, warps, prefetch). A thread holds
# R = BLOCK_N * NSB / (8 * warps) (row, block) pairs of one run when NSB >= 8: more rows share
# each x value (R = 8: 3.4 instructions per Q4_K weight, R = 4: 3.7, R = 2: 4.2), more blocks
# per step keep more bytes in flight (narrow N), prefetch doubles the registers. R <= 4: R = 8
# needs 255 registers (Q5_K), and for Q4_K spilled once every tile loaded its first step ahead
# of the PDL wait (the words then live across the loop's back edge); its tiles were not picked.
_TILES_Q4 = ((16, 8, 4, False), (4, 8, 1, False), (8, 8, 4, False), (8, 16, 4, False),
             (16, 8, 4, True), (8, 8, 4, True))
_TILES_Q5 = ((16, 8, 4, False), (4, 8, 1, False), (8, 8, 2, False), (8, 8, 4, False),
             (8, 16, 4, False), (4, 16, 2, False), (8, 8, 4, True), (4, 8, 2, True))
GEMV_CONFIGS, GEMV_CONFIGS_Q5 = (
    [triton.Config({"BLOCK_N": bn, "NSB": nsb, "PREFETCH": pf}, num_warps=w)
     for bn, nsb, w, pf in tiles] for tiles in (_TILES_Q4, _TILES_Q5))
_EVEN = triton.heuristics({"EVEN": lambda a: a["K"] // 256 % a["NSB"] == 0})
_tuned_q4 = warmup_autotune(GEMV_CONFIGS, ["N", "K", "GATED"])(_EVEN(_kquant_gemv_kernel))
_tuned_q5 = warmup_autotune(GEMV_CONFIGS_Q5, ["N", "K", "GATED"])(_EVEN(_kquant_gemv_kernel))


def kquant_gemv_triton(x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                       block_n: int | None = None, nsb: int = 8, prefetch: bool = False,
                       num_warps: int = 4, gated: bool = False, pdl: str = "auto"
                       ) -> torch.Tensor:
    """x [M, K] (small M; one program row per x row) @ dequant(qweight).T -> [M, N], or gated
    (rows [gate; up]) silu(gate) * up [M, N / 2]. On CUDA without a pinned block_n the tile is
    autotuned (before any CUDA-graph capture)."""
    if int(qtype) not in (Q4_K, Q5_K):
        raise ValueError("kquant_gemv_triton decodes Q4_K and Q5_K only")
    t = gguf_type(qtype)
    n, k = qweight.shape[0], qweight.shape[1] // t.type_size * 256
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {k}] with unit stride along K")
    if qweight.dtype != torch.uint8 or qweight.stride(1) != 1 or qweight.stride(0) % 4:
        raise ValueError("qweight must be uint8 [N, row_bytes] with contiguous rows")
    use_asm = x.is_cuda and not INTERPRET
    if use_asm and (qweight.stride(0) % 16 or qweight.data_ptr() % 16):
        raise ValueError("qweight rows must be 16-byte aligned (16-byte loads)")
    five = int(qtype) == Q5_K
    return lane_gemv(
        _tuned_q5 if five else _tuned_q4, _kquant_gemv_kernel, x, n, gated,
        lambda out: (x, qweight, out, n, k, x.stride(0), qweight.stride(0), out.stride(0)),
        dict(FIVE_BITS=five, TYPE_SIZE=t.type_size), 256, block_n, nsb, prefetch, num_warps,
        pdl)
