"""FP8 (e4m3) decode GEMV on the CUDA cores: y [M, N] = x [M, K] @ (W8 * scale).T, one program
row per x row (decode-sized M).

Work split as the 4-bit GEMV (kernels/w4a16_gemv.py): element (row, block, run p) of a
[BLOCK_N, NSB, 4] index space dots one run of 32 weights (two 16-byte loads, `load16`) with its
32 x values; lanes lie along runs, warps along rows, so x is loaded and converted once per thread
for all of its BLOCK_N / warps rows and nothing crosses threads before the end.

Conversion: four e4m3 bytes of a word become four float32 with two `cvt.rn.f16x2.e4m3x2` (exact:
every e4m3 value is an fp16) and four f16 -> f32 conversions, then one FMA a weight: ~2.6 SASS
instructions per weight (tests/quant/sm90_compile.py), against ~1 byte per weight of traffic.
The tensor-core GEMV (kernels/fp8_gemv.py) spends fewer instructions (1.4-1.9) but pays a
pipeline prologue, x rescaling into fp16 range and split-K partials on every launch, which the
small decode matrices (q/k/v, o) cannot hide; which of the two serves M <= 2 is
`kernels/fp8.py`'s choice (FLOTILLA_FP8_GEMV).

Scales: per channel (group == K) multiply each row's sum once; group scales (groups a multiple
of 32) scale each run's dot. Rows past N read row N - 1 and runs past K the last run (the asm
loads take no mask); neither is stored nor counted. The interpreter runs plain forms of the asm.
"""

from __future__ import annotations

import torch

from flotilla.kernels.code_floats import INTERPRET
from flotilla.kernels.gemv_rows import gemv_rows, gemv_store, lane_gemv
from flotilla.kernels.pdl import pdl_wait_after
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.tuning import warmup_autotune
from flotilla.kernels.vector_loads import load_run, load_scalars, x8

RUN = 32  # weights per (row, run) element: K and the group size must be multiples of it
_E4M3X4_ASM = tl.constexpr("""
{
.reg .b16 lo, hi, a0, a1, a2, a3;
.reg .b32 h0, h1;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h0, lo;
cvt.rn.f16x2.e4m3x2 h1, hi;
mov.b32 {a0, a1}, h0;
mov.b32 {a2, a3}, h1;
cvt.f32.f16 $0, a0;
cvt.f32.f16 $1, a1;
cvt.f32.f16 $2, a2;
cvt.f32.f16 $3, a3;
}
""")


@triton.jit
def _e4m3_byte(w, j: tl.constexpr):
    """Byte j of each int32 word, as e4m3, in float32 (the interpreter's form of the asm)."""
    return ((w >> (8 * j)) & 255).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e4m3x4(w, USE_ASM: tl.constexpr):
    """int32 words of four e4m3 bytes -> 4 float32 tensors, byte j the j-th."""
    if USE_ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            _E4M3X4_ASM, "=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    else:
        f0, f1, f2, f3 = _e4m3_byte(w, 0), _e4m3_byte(w, 1), _e4m3_byte(w, 2), _e4m3_byte(w, 3)
    return f0, f1, f2, f3


@triton.jit
def _dot_words(d, wa, wb, x_row, off, X_WORDS: tl.constexpr, USE_ASM: tl.constexpr):
    """Adds two words (8 weights) against x[2 * off + 0..7] to d."""
    x0, x1, x2, x3, x4, x5, x6, x7 = x8(x_row, off, X_WORDS, USE_ASM)
    a0, a1, a2, a3 = e4m3x4(wa, USE_ASM)
    b0, b1, b2, b3 = e4m3x4(wb, USE_ASM)
    return d + a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3 + b0 * x4 + b1 * x5 + b2 * x6 + b3 * x7


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # e4m3 [N, K], 16-byte aligned rows
    s_ptr,  # float32 [N, K // group] scales
    out_ptr,  # [M, N] in x's dtype
    N,
    K,
    stride_xm,
    stride_wn,  # bytes between weight rows
    stride_sn,
    stride_om,
    group,
    PER_CHANNEL: tl.constexpr,  # group == K
    GATED: tl.constexpr,  # [gate; up] rows: store silu(gate) * up (kernels/gemv_rows.py)
    USE_ASM: tl.constexpr,  # CUDA: inline PTX loads and conversions
    X_WORDS: tl.constexpr,  # 16-bit x with 16-byte aligned rows: read as int32 pairs
    EVEN: tl.constexpr,  # K is a multiple of 128 * NSB
    BLOCK_N: tl.constexpr,
    NSB: tl.constexpr,  # 128-weight blocks (4 runs) per loop step
    PREFETCH: tl.constexpr,  # load step i + 1 before the arithmetic of step i
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py)
):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows_c = gemv_rows(pid_n, N, BLOCK_N, GATED)[:, None, None]
    w_rows = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rows_c * (stride_wn // 4)
    s_rows = s_ptr + rows_c * stride_sn
    x_row = x_ptr + m * stride_xm
    nruns = K // 32
    runs = tl.arange(0, NSB)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, NSB, 4]
    acc = tl.zeros([BLOCK_N, NSB, 4], dtype=tl.float32)
    # step 0's words first: with PDL they load while the previous kernel finishes, and the
    # wait for x (that kernel's output) comes once they are in (kernels/pdl.py)
    w = load_run(w_rows, runs if EVEN else tl.minimum(runs, nruns - 1), USE_ASM)
    x_row += pdl_wait_after(w[0], USE_PDL)
    for r0 in range(0, nruns, NSB * 4):
        r = r0 + runs
        if not EVEN:
            r_ok = r < nruns
            r = tl.minimum(r, nruns - 1)
        r_next = r0 + NSB * 4 + runs
        if not EVEN:
            r_next = tl.minimum(r_next, nruns - 1)
        if PREFETCH:  # issue the next step's loads before this step's arithmetic
            if r0 + NSB * 4 < nruns:
                w_next = load_run(w_rows, r_next, USE_ASM)
            else:
                w_next = w
        w0, w1, w2, w3, w4, w5, w6, w7 = w
        d = _dot_words(0.0, w0, w1, x_row, r * 16, X_WORDS, USE_ASM)
        d = _dot_words(d, w2, w3, x_row, r * 16 + 4, X_WORDS, USE_ASM)
        d = _dot_words(d, w4, w5, x_row, r * 16 + 8, X_WORDS, USE_ASM)
        d = _dot_words(d, w6, w7, x_row, r * 16 + 12, X_WORDS, USE_ASM)
        if not EVEN:
            d = tl.where(r_ok, d, 0.0)
        if PER_CHANNEL:
            acc += d
        else:
            acc += load_scalars(s_rows + (r * 32) // group, USE_ASM) * d
        if PREFETCH:
            w = w_next
        elif r0 + NSB * 4 < nruns:  # the next step's words, after this step's arithmetic
            w = load_run(w_rows, r_next, USE_ASM)
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if PER_CHANNEL:
        out = out * tl.load(s_ptr + gemv_rows(pid_n, N, BLOCK_N, GATED) * stride_sn)
    gemv_store(out, out_ptr + m * stride_om, pid_n, N, BLOCK_N, GATED)


# (BLOCK_N, NSB, warps, prefetch), keyed on (N, K, group) on CUDA: a thread holds BLOCK_N /
# warps rows of one run when NSB = 8 (32 lanes along the runs of 8 blocks)
_TILES = ((16, 8, 4, False), (32, 8, 4, False), (8, 8, 4, False), (4, 8, 1, False),
          (8, 8, 2, False), (8, 16, 4, False), (16, 8, 4, True), (8, 8, 4, True))
GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "NSB": nsb, "PREFETCH": pf}, num_warps=w)
                for bn, nsb, w, pf in _TILES]
_EVEN = triton.heuristics({"EVEN": lambda a: a["K"] % (128 * a["NSB"]) == 0})
_tuned = warmup_autotune(GEMV_CONFIGS, ["N", "K", "group", "GATED"])(_EVEN(_gemv_kernel))


def fma_gemv_ok(x2: torch.Tensor, weight: torch.Tensor, group: int) -> bool:
    """K and the group size multiples of 32; on CUDA, 16-byte aligned weight rows."""
    k = weight.shape[1]
    if k % RUN or group % RUN:
        return False
    if x2.is_cuda and not INTERPRET:
        return weight.data_ptr() % 16 == 0 and weight.stride(0) % 16 == 0
    return True


def fp8_gemv_fma(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int,
                 block_n: int | None = None, nsb: int = 8, prefetch: bool = False,
                 num_warps: int = 4, gated: bool = False, pdl: str = "auto") -> torch.Tensor:
    """x2 [M, K] (unit stride along K) @ dequant(weight, scale).T -> [M, N] in x2's dtype, or
    gated (rows [gate; up]) silu(gate) * up [M, N / 2] (arguments checked by kernels/fp8.py).
    On CUDA without a pinned block_n the tile is autotuned (before any CUDA-graph capture)."""
    n, k = weight.shape
    return lane_gemv(
        _tuned, _gemv_kernel, x2, n, gated,
        lambda out: (x2, weight, scale, out, n, k, x2.stride(0), weight.stride(0),
                     scale.stride(0), out.stride(0), group),
        dict(PER_CHANNEL=group == k), 128, block_n, nsb, prefetch, num_warps, pdl)
