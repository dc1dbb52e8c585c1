"""GEMM for Q4_K / Q5_K blocks (batched decode and prefill, M > GEMV_MAX_M): y = x @ W.T with W
kept quantized (block layout: kernels/gguf_kquant_gemv.py).

Each loop step decodes one super-block of BLOCK_N rows into a [BLOCK_N, 256] tile in x's dtype
and multiplies it with x on the tensor cores (wgmma at BLOCK_M 64). The decode costs per weight
one PRMT (a code byte put into byte 2 of 0.5f is 0.5 + code / 256: kernels/code_floats.py),
one FMA and half a conversion: with f = 0.5 + q / 256,

    w = d * sc * q - dmin * mn = f * (256 d sc) - (128 d sc + dmin mn)

whose two constants are worked out once per (row, sub-block), from the 12 scale bytes decoded
a word at a time. Code word w of run p holds bytes j = 0..3: low nibbles are weights
64p + 4w + j (sub-block 2p), high nibbles 64p + 32 + 4w + j (sub-block 2p + 1); the decoded
values are joined per word and the tile permuted into natural K order (a layout change, free:
the tile goes through shared memory to the MMA anyway), so x is read as it lies.
SASS per weight in the loop (tests/quant/sm90_compile.py kquantgemm): 4.7-4.9 (Q4_K), 5.2-5.5
(Q5_K); the generic GEMM of kernels/gguf_matmul.py takes 8.9-10.1 / 11.2-12.1.
"""

from __future__ import annotations

import torch

from flotilla.kernels.code_floats import INTERPRET, codes4
from flotilla.kernels.gemm_tile import store_tile
from flotilla.kernels.gguf_dequant import Q4_K, Q5_K, gguf_type
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.vector_loads import f16_low


@triton.jit
def _weights(q, qh, p: tl.constexpr, a_lo, b_lo, a_hi, b_hi, FIVE_BITS: tl.constexpr,
             USE_ASM: tl.constexpr, dt: tl.constexpr):
    """Code words q [BLOCK_N, 8] of run p -> weights [BLOCK_N, 8, 8] in dt, element (w, 2j + h)
    weight 4w + j of sub-block 2p + h (a_*, b_*: [BLOCK_N, 1] constants of the two sub-blocks;
    qh: the block's fifth-bit words, Q5_K)."""
    lo = q & 0x0F0F0F0F
    hi = (q >> 4) & 0x0F0F0F0F
    if FIVE_BITS:  # bits 2p / 2p + 1 of each qh byte are the fifth bits of lo / hi
        r = qh >> (2 * p)
        lo = lo | ((r << 4) & 0x10101010)
        hi = hi | ((r << 3) & 0x10101010)
    l0, l1, l2, l3 = codes4(lo, USE_ASM)
    h0, h1, h2, h3 = codes4(hi, USE_ASM)
    w_lo = tl.join(tl.join((l0 * a_lo - b_lo).to(dt), (l2 * a_lo - b_lo).to(dt)),
                   tl.join((l1 * a_lo - b_lo).to(dt), (l3 * a_lo - b_lo).to(dt)))
    w_hi = tl.join(tl.join((h0 * a_hi - b_hi).to(dt), (h2 * a_hi - b_hi).to(dt)),
                   tl.join((h1 * a_hi - b_hi).to(dt), (h3 * a_hi - b_hi).to(dt)))
    return tl.reshape(tl.join(w_lo, w_hi), [q.shape[0], 8, 8])


@triton.jit
def _kquant_gemm_kernel(
    x_ptr,  # [M, K] activations, unit stride along K
    w_ptr,  # uint8 [N, row_bytes] Q4_K / Q5_K blocks, rows at 4-byte aligned offsets
    out_ptr,  # [M, N]: x's dtype, or fp32 (zero-filled) when split_k > 1
    M,
    N,
    K,
    stride_xm,
    stride_wn,  # bytes between weight rows
    stride_om,
    split_k,  # programs sharing one output tile, each a run of blocks
    FIVE_BITS: tl.constexpr,  # Q5_K
    TYPE_SIZE: tl.constexpr,  # 144 (Q4_K) or 176 (Q5_K)
    USE_ASM: tl.constexpr,  # CUDA: codes to floats by inline PTX
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ATOMIC: tl.constexpr,  # split_k > 1: fp32 atomics into a zero-filled out
    DOT_PRECISION: tl.constexpr,  # for float32 x: "tf32" or "ieee"
):
    TW: tl.constexpr = TYPE_SIZE // 4  # int32 words per block
    QS: tl.constexpr = 12 if FIVE_BITS else 4  # word offset of the code runs
    dt: tl.constexpr = x_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    nblocks = K // 256
    per_split = tl.cdiv(nblocks, split_k)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, nblocks)
    # rows past N read row N - 1 (in bounds, no masks); their columns are not stored
    w_rows = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) \
        + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * (stride_wn // 4)
    offs8 = tl.arange(0, 8)[None, :]
    # x of one block in natural order [BLOCK_M, p, h, w, j], permuted to the tile's [p, w, j, h]
    kx = tl.arange(0, 256)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kx[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(first, last):
        blk = w_rows + b * TW
        dd, s0, s1, s2 = _header(blk)
        d = f16_low(dd)
        dmin = f16_low(dd >> 16)
        # 6-bit scales / mins of sub-blocks 0-3 and 4-7 as bytes, then 0.5 + byte / 256 floats:
        # A = 256 d sc = 65536 d f - 32768 d, B = 128 d sc + dmin mn, exact up to 2^-10 d
        sc_a, sc_b, sc_c, sc_d = codes4(s0 & 0x3F3F3F3F, USE_ASM)
        sc_e, sc_f, sc_g, sc_h = codes4((s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030), USE_ASM)
        mn_a, mn_b, mn_c, mn_d = codes4(s1 & 0x3F3F3F3F, USE_ASM)
        mn_e, mn_f, mn_g, mn_h = codes4(((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030),
                                         USE_ASM)
        da = 65536.0 * d
        db = 32768.0 * d
        dm = 256.0 * dmin
        c0 = -(16384.0 * d + 128.0 * dmin)
        if FIVE_BITS:
            qh = tl.load(blk + 4 + offs8)
        else:
            qh = s0  # unused
        x = tl.load(x_rows + b * 256, mask=m_ok[:, None], other=0.0)
        w0 = _run(blk, qh, 0, sc_a, sc_b, mn_a, mn_b, da, db, dm, c0, QS, FIVE_BITS, USE_ASM, dt)
        w1 = _run(blk, qh, 1, sc_c, sc_d, mn_c, mn_d, da, db, dm, c0, QS, FIVE_BITS, USE_ASM, dt)
        w2 = _run(blk, qh, 2, sc_e, sc_f, mn_e, mn_f, da, db, dm, c0, QS, FIVE_BITS, USE_ASM, dt)
        w3 = _run(blk, qh, 3, sc_g, sc_h, mn_g, mn_h, da, db, dm, c0, QS, FIVE_BITS, USE_ASM, dt)
        w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_N, 8, 4, 2, 2, 2])
        w = tl.reshape(tl.permute(w, [0, 4, 5, 3, 1, 2]), [BLOCK_N, 256])
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    store_tile(out_ptr, acc, rm, rn, m_ok, n_ok, stride_om, ATOMIC)


@triton.jit
def _header(blk):
    """The 4 header words of each block (d | dmin, 12 scale bytes): one 16-byte load."""
    h = tl.load(blk + tl.arange(0, 4)[None, :])
    h01, h23 = tl.split(tl.reshape(h, [h.shape[0], 2, 2]))
    h0, h2 = tl.split(h01)
    h1, h3 = tl.split(h23)
    return h0, h1, h2, h3


@triton.jit
def _run(blk, qh, p: tl.constexpr, sc_lo, sc_hi, mn_lo, mn_hi, da, db, dm, c0, QS: tl.constexpr,
         FIVE_BITS: tl.constexpr, USE_ASM: tl.constexpr, dt: tl.constexpr):
    """Run p of the block at blk ([BLOCK_N, 1] word pointers) as weights [BLOCK_N, 8, 8];
    sc / mn: its sub-blocks' scales and mins as 0.5 + byte / 256."""
    q = tl.load(blk + QS + 8 * p + tl.arange(0, 8)[None, :])
    a_lo = (sc_lo * da - 0.5 * da)[:, None]
    a_hi = (sc_hi * da - 0.5 * da)[:, None]
    b_lo = (sc_lo * db + (mn_lo * dm + c0))[:, None]
    b_hi = (sc_hi * db + (mn_hi * dm + c0))[:, None]
    return _weights(q, qh, p, a_lo, b_lo, a_hi, b_hi, FIVE_BITS, USE_ASM, dt)


def kquant_gemm_config(m: int) -> tuple[int, int, int]:
    """CUDA tile (BLOCK_M, BLOCK_N, warps). BLOCK_M is 64 even for a few rows: Hopper's wgmma
    takes 64 rows and reads the weight tile from shared memory once (mma.sync at BLOCK_M 16
    spends ~0.7 more instructions per weight moving it into registers); the tensor cores idle
    either way at decode sizes."""
    return (64, 64, 4) if m <= 64 else (64, 128, 8)


def kquant_gemm_ok(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> bool:
    """The kernel reads the blocks as int32 words and, on CUDA, takes 16-bit x."""
    return (int(qtype) in (Q4_K, Q5_K) and qweight.stride(0) % 4 == 0
            and qweight.data_ptr() % 4 == 0
            and (not x.is_cuda or x.dtype in (torch.float16, torch.bfloat16)))


def kquant_gemm_launch(x: torch.Tensor, qweight: torch.Tensor, qtype: int, out: torch.Tensor,
                       block_m: int, block_n: int, split_k: int, num_warps: int = 4) -> None:
    """out [M, N] (fp32 zero-filled when split_k > 1, else x's dtype) = x [M, K] (unit stride
    along K) @ dequant(qweight [N, row_bytes]).T; tiles and split_k chosen by the caller
    (kernels/gguf_matmul.py)."""
    if not kquant_gemm_ok(x, qweight, qtype):
        raise ValueError("kquant GEMM: Q4_K / Q5_K rows at 4-byte aligned offsets, 16-bit x "
                         "on CUDA")
    t = gguf_type(qtype)
    m, k = x.shape
    n = qweight.shape[0]
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _kquant_gemm_kernel[grid](
        x, qweight, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0), split_k,
        FIVE_BITS=int(qtype) == Q5_K, TYPE_SIZE=t.type_size,
        USE_ASM=x.is_cuda and not INTERPRET, BLOCK_M=block_m, BLOCK_N=block_n,
        ATOMIC=split_k > 1,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=2,
    )
