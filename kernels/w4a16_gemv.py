"""Decode GEMV for 4-bit weights (GPTQ / AWQ after loading; layout in kernels/w4a16.py).

Work split, as the Q4_K GEMV (kernels/gguf_kquant_gemv.py): element (row, block, run p) of a
[BLOCK_N, NSB, 4] index space dots one run of 64 weights (8 int32 words: two 16-byte loads,
`load16`) of a 256-weight block with its 64 x values. The lanes of a warp lie along runs and
blocks, the warps along rows, so a thread holds BLOCK_N / warps rows of one run: x is loaded (16
bytes a word) and converted once per thread for all of them, and nothing crosses threads before
the end (the earlier tl.load kernel moved x through shared memory with a barrier per step).

A run lies in one group (the group size is a multiple of 64), so per (row, run), with codes
as f = 0.5 + code / 256 (kernels/code_floats.py: one PRMT each),

    sum_l (code_l - zero) * scale * x_l = scale * (256 * sum_l f_l x_l - (128 + zero) * S)

with S = sum_l x_l. Word j of a run holds weights 8j .. 8j + 7, weight 8j + i in bits 4i ..
4i + 3: its low nibbles (q & 0x0F0F0F0F) are weights 8j + 0, 2, 4, 6 and the high ones 1, 3,
5, 7, against the even and odd halves of x's bf16 pairs. GPTQ act-order (perm) gathers x by
perm inside the loop. Rows past N read row N - 1 (the asm loads take no mask) and runs past K
the last run, with a zero scale; neither is stored.
"""

from __future__ import annotations

import torch

from flotilla.kernels.code_floats import INTERPRET, bf16_pair, codes4
from flotilla.kernels.gemv_rows import gemv_rows, gemv_store, lane_gemv
from flotilla.kernels.pdl import pdl_wait_after
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.tuning import warmup_autotune
from flotilla.kernels.vector_loads import _f16_pair, load16, load_run, load_scalars, x8

RUN = 64  # weights per (row, run) element: the group size must be a multiple of it


@triton.jit
def _x8_perm(x_row, perm_ptr, k0, USE_ASM: tl.constexpr):
    """x[perm[k0 + i]], i = 0..7, as float32 (act-order: k0 a multiple of 8)."""
    p0, p1, p2, p3 = load16(perm_ptr + k0, USE_ASM)
    p4, p5, p6, p7 = load16(perm_ptr + k0 + 4, USE_ASM)
    return (tl.load(x_row + p0).to(tl.float32), tl.load(x_row + p1).to(tl.float32),
            tl.load(x_row + p2).to(tl.float32), tl.load(x_row + p3).to(tl.float32),
            tl.load(x_row + p4).to(tl.float32), tl.load(x_row + p5).to(tl.float32),
            tl.load(x_row + p6).to(tl.float32), tl.load(x_row + p7).to(tl.float32))


@triton.jit
def _x_pair(x_row, perm_ptr, k, HAS_PERM: tl.constexpr, X_WORDS: tl.constexpr):
    """x[k], x[k + 1] as float32 (k even; act-order: x[perm[k]], x[perm[k + 1]])."""
    if HAS_PERM:
        return (tl.load(x_row + tl.load(perm_ptr + k)).to(tl.float32),
                tl.load(x_row + tl.load(perm_ptr + k + 1)).to(tl.float32))
    elif X_WORDS:
        w = tl.load(x_row.to(tl.pointer_type(tl.int32), bitcast=True) + k // 2)
        if x_row.dtype.element_ty == tl.float16:
            return _f16_pair(w)
        else:
            return bf16_pair(w)
    else:
        return tl.load(x_row + k).to(tl.float32), tl.load(x_row + k + 1).to(tl.float32)


@triton.jit
def _dot_word(d, s, q, x_row, perm_ptr, r, j: tl.constexpr, HAS_PERM: tl.constexpr,
              X_WORDS: tl.constexpr, USE_ASM: tl.constexpr, MARLIN: tl.constexpr):
    """Adds word j of run r: sum f * x to d, sum x to s. MARLIN (kernels/w4a16_marlin.py's
    re-packed layout): nibble i + 4h of the word is weight 16i + 2j + h of the run, so the
    word's x values are four bf16 pairs 16 apart instead of eight consecutive ones."""
    if MARLIN:
        k = r * 64 + 2 * j
        x0, x4 = _x_pair(x_row, perm_ptr, k, HAS_PERM, X_WORDS)  # nibbles 0 and 4
        x1, x5 = _x_pair(x_row, perm_ptr, k + 16, HAS_PERM, X_WORDS)
        x2, x6 = _x_pair(x_row, perm_ptr, k + 32, HAS_PERM, X_WORDS)
        x3, x7 = _x_pair(x_row, perm_ptr, k + 48, HAS_PERM, X_WORDS)
    elif HAS_PERM:
        x0, x1, x2, x3, x4, x5, x6, x7 = _x8_perm(x_row, perm_ptr, r * 64 + 8 * j, USE_ASM)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = x8(x_row, r * 32 + 4 * j, X_WORDS, USE_ASM)
    s += ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    a0, a1, a2, a3 = codes4(q & 0x0F0F0F0F, USE_ASM)  # nibbles 0, 2, 4, 6
    b0, b1, b2, b3 = codes4((q >> 4) & 0x0F0F0F0F, USE_ASM)  # nibbles 1, 3, 5, 7
    d = d + a0 * x0 + b0 * x1 + a1 * x2 + b1 * x3 + a2 * x4 + b2 * x5 + a3 * x6 + b3 * x7
    return d, s


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    q_ptr,  # int32 [N, K // 8], 16-byte aligned rows
    s_ptr,  # fp16 [N, K // G] scales
    z_ptr,  # uint8 [N, K // G] zeros
    perm_ptr,  # int32 [K] (HAS_PERM)
    out_ptr,  # [M, N] in x's dtype
    N,
    K,
    stride_xm,
    stride_q,  # int32 words between weight rows
    stride_s,
    stride_om,
    group_size,
    HAS_PERM: tl.constexpr,
    GATED: tl.constexpr,  # [gate; up] rows: store silu(gate) * up (kernels/gemv_rows.py)
    USE_ASM: tl.constexpr,  # CUDA: inline PTX loads and code conversion
    X_WORDS: tl.constexpr,  # 16-bit x with 16-byte aligned rows: read as int32 pairs
    EVEN: tl.constexpr,  # K is a multiple of 256 * NSB
    BLOCK_N: tl.constexpr,
    NSB: tl.constexpr,  # 256-weight blocks per loop step
    PREFETCH: tl.constexpr,  # load step i + 1 before the arithmetic of step i
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py)
    MARLIN: tl.constexpr = False,  # the re-packed layout of kernels/w4a16_marlin.py
):
    STEP: tl.constexpr = NSB * 4  # runs per loop step
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows_c = gemv_rows(pid_n, N, BLOCK_N, GATED)[:, None, None]
    q_rows = q_ptr + rows_c * stride_q
    sz_rows = rows_c * stride_s
    nruns = K // 64
    runs = tl.arange(0, NSB)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, NSB, 4]
    acc = tl.zeros([BLOCK_N, NSB, 4], dtype=tl.float32)
    # step 0's words first: with PDL they load while the previous kernel finishes, and the
    # wait for x (that kernel's output) comes once they are in (kernels/pdl.py)
    w = load_run(q_rows, runs if EVEN else tl.minimum(runs, nruns - 1), USE_ASM)
    x_row = x_ptr + m * stride_xm + pdl_wait_after(w[0], USE_PDL)
    for r0 in range(0, nruns, STEP):
        r = r0 + runs
        if not EVEN:
            r_ok = r < nruns
            r = tl.minimum(r, nruns - 1)
        r_next = r0 + STEP + runs
        if not EVEN:
            r_next = tl.minimum(r_next, nruns - 1)
        if PREFETCH:  # issue the next step's loads before this step's arithmetic
            if r0 + STEP < nruns:
                w_next = load_run(q_rows, r_next, USE_ASM)
            else:
                w_next = w
        q0, q1, q2, q3, q4, q5, q6, q7 = w
        d, s = _dot_word(0.0, 0.0, q0, x_row, perm_ptr, r, 0, HAS_PERM, X_WORDS, USE_ASM,
                        MARLIN)
        d, s = _dot_word(d, s, q1, x_row, perm_ptr, r, 1, HAS_PERM, X_WORDS, USE_ASM,
                        MARLIN)
        d, s = _dot_word(d, s, q2, x_row, perm_ptr, r, 2, HAS_PERM, X_WORDS, USE_ASM,
                        MARLIN)
        d, s = _dot_word(d, s, q3, x_row, perm_ptr, r, 3, HAS_PERM, X_WORDS, USE_ASM,
                        MARLIN)
        d, s = _dot_word(d, s, q4, x_row, perm_ptr, r, 4, HAS_PERM, X_WORDS, USE_ASM,
                        MARLIN)
        d, s = _dot_word(d, s, q5, x_row, perm_ptr, r, 5, HAS_PERM, X_WORDS, USE_ASM,
                        MARLIN)
        d, s = _dot_word(d, s, q6, x_row, perm_ptr, r, 6, HAS_PERM, X_WORDS, USE_ASM,
                        MARLIN)
        d, s = _dot_word(d, s, q7, x_row, perm_ptr, r, 7, HAS_PERM, X_WORDS, USE_ASM,
                        MARLIN)
        grp = sz_rows + (r * 64) // group_size
        scale = load_scalars(s_ptr + grp, USE_ASM)
        zero = load_scalars(z_ptr + grp, USE_ASM)
        if not EVEN:
            scale = tl.where(r_ok, scale, 0.0)
        acc += scale * (256.0 * d - (128.0 + zero) * s)
        if PREFETCH:
            w = w_next
        elif r0 + STEP < nruns:  # the next step's words, after this step's arithmetic
            w = load_run(q_rows, r_next, USE_ASM)
    gemv_store(tl.sum(tl.sum(acc, axis=2), axis=1), out_ptr + m * stride_om, pid_n, N, BLOCK_N,
               GATED)


# (BLOCK_N, NSB, warps, prefetch), keyed on (N, K, group) on CUDA: a thread holds BLOCK_N /
# warps rows of one run when NSB = 8 (32 lanes along the runs of 8 blocks). Split-K (programs
# over slices of K, finished in the same launch) was measured on an H100 and never picked for
# Llama-3-8B's matrices; it is not offered.
_TILES = ((16, 8, 4, False), (32, 8, 4, False), (8, 8, 4, False), (4, 8, 1, False),
          (16, 8, 2, False), (8, 16, 4, False), (16, 8, 4, True), (8, 8, 4, True),
          # 4 blocks a step: more, shorter steps, so prefetch overlaps more of a narrow matrix
          (32, 4, 4, True), (16, 4, 2, False), (8, 4, 2, True),
          # more warps along K (NSB 16-32: 2-4 warps share a row block's x range; down picks
          # 8 x 32 on an H100)
          (8, 32, 4, False), (16, 16, 8, False), (4, 16, 2, False), (8, 16, 4, True),
          (16, 16, 4, False))
GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "NSB": nsb, "PREFETCH": pf}, num_warps=w)
                for bn, nsb, w, pf in _TILES]
_EVEN = triton.heuristics({"EVEN": lambda a: a["K"] % (256 * a["NSB"]) == 0})
# one autotuner per (act-order, re-packed layout): each keeps its own tile per shape
_TUNED = {(perm, marlin): warmup_autotune(GEMV_CONFIGS, ["N", "K", "group_size", "GATED"])(
    _EVEN(_gemv_kernel)) for perm in (False, True) for marlin in (False, True)}
_tuned, _tuned_perm = _TUNED[False, False], _TUNED[True, False]


def gemv_ok(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
            perm: torch.Tensor | None) -> bool:
    """This GEMV takes groups that are multiples of 64 (groups of 32 decode through the GEMM),
    fp16 scales and (CUDA) 16-byte aligned weight rows and act-order permutation."""
    if group_size % RUN or scales.dtype != torch.float16:
        return False
    if x2.is_cuda and not INTERPRET:
        return (qweight.data_ptr() % 16 == 0 and qweight.stride(0) % 4 == 0
                and (perm is None or perm.data_ptr() % 16 == 0))
    return True


def w4a16_gemv(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None,
               block_n: int | None = None, nsb: int = 8, prefetch: bool = False,
               num_warps: int = 4, gated: bool = False, pdl: str = "auto",
               marlin: bool = False) -> torch.Tensor:
    """x2 [M, K] (a few rows: one program row each) -> [M, N] in x2's dtype, or gated (weight
    rows [gate; up]) silu(gate) * up [M, N / 2]; arguments checked by kernels/w4a16.py. On CUDA
    without a pinned block_n the tile is autotuned (before any CUDA-graph capture). marlin:
    qweight is in kernels/w4a16_marlin.py's re-packed layout."""
    n = qweight.shape[0]
    return lane_gemv(
        _TUNED[perm is not None, marlin], _gemv_kernel, x2, n, gated,
        lambda out: (x2, qweight, scales, zeros, qweight if perm is None else perm, out, n,
                     x2.shape[1], x2.stride(0), qweight.stride(0), scales.stride(0),
                     out.stride(0), group_size),
        dict(HAS_PERM=perm is not None, MARLIN=marlin), 256, block_n, nsb, prefetch, num_warps,
        pdl)
