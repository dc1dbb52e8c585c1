"""4-bit x 16-bit GEMM on tensor cores over a load-time re-packed ("Marlin-style") layout.

Layout (`marlin_pack`, applied once when a GPTQ/AWQ layer is loaded): qweight int32 [N, K / 8]
as kernels/w4a16.py's, but inside each 64-weight block of a row (8 words) the weights are
placed for the MMA operand registers rather than in K order:

    word w (0..7) of the block, nibble p = j + 4h (j = 0..3, h = 0..1) holds k = 16j + 2w + h

so one LOP3 of a word with 0x000F000F | MAGIC gives two 16-bit floats 128 + code (bf16,
exponent bits 0x4300) or 1024 + code (fp16, 0x6400) for the adjacent k = 16j + 2w, 16j + 2w + 1
of nibble plane j: exactly the two K elements an mma.sync operand register holds (Triton's dot
operand layout, kWidth 2). One more packed-half instruction subtracts 128 + zero (exact: the
results are small integers). The kernel computes, per K step of BLOCK_K (within one group),

    acc += scale[n] * sum_j  x[:, plane j's k] . (code - zero)_j^T      j = 0..3

four dots of K = BLOCK_K / 4 whose x operand is 16-column runs of x (x read once per step,
no stride-8 gathers), and the group scale applied once per output after the dots. There is no
K-order rebuild and no per-weight float conversion or FMA: ~1 LOP3/SHF + 0.5 HSUB2 per weight.
Groups must be multiples of 64 (smaller groups keep the plain layout, kernels/w4a16_mma.py).
Weight rows are the MMA's N (x rows, padded to 16, its M); split-K as kernels/split_k.py.
The batch-1 GEMV reads the same layout (kernels/w4a16_gemv.py, MARLIN=True): one copy.
"""

from __future__ import annotations

import torch

from flotilla.kernels.code_floats import INTERPRET
from flotilla.kernels.split_k import LOCKS, lock_buffer, split_k_store
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.tuning import warmup_autotune

BLOCK = 64  # weights of one re-packed block (8 words) along K
SPLIT_MAX = 8
MAX_TUNED_M = 64  # up to this many rows (decode batches) the tile is autotuned per M; prefill
# rows take one fixed tile without split-K


def marlin_order(k: int) -> torch.Tensor:
    """int64 [K]: position i of the re-packed code order (8i + p: word i // 8, nibble p) holds
    weight k = order[i] of the kernel order."""
    b, w, h, j = torch.meshgrid(torch.arange(k // BLOCK), torch.arange(8), torch.arange(2),
                                torch.arange(4), indexing="ij")
    return (BLOCK * b + 16 * j + 2 * w + h).reshape(-1)


def marlin_pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (kernel order, K % 64 == 0) -> int32 [N, K / 8] re-packed."""
    from flotilla.kernels.w4a16 import pack_int4  # (kernels/w4a16.py imports this module)

    if codes.shape[1] % BLOCK:
        raise ValueError(f"the re-packed 4-bit layout needs K % {BLOCK} == 0, not "
                         f"{codes.shape[1]}")
    return pack_int4(codes[:, marlin_order(codes.shape[1]).to(codes.device)])


def marlin_unpack(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of marlin_pack: int32 [N, K / 8] -> uint8 codes [N, K] in kernel order."""
    from flotilla.kernels.w4a16 import unpack_int4

    packed = unpack_int4(qweight)
    order = marlin_order(packed.shape[1]).to(qweight.device)
    return torch.empty_like(packed).index_copy_(1, order, packed)


def _dequant_asm(magic: int, sub: str) -> str:
    """Two packed words ($4, $5: the same word) and 16-bit pairs of 128 + zero / 1024 + zero
    ($6, $7) -> planes j = 0..3 as pairs (nibble j, nibble j + 4) minus the zero ($0 .. $3)."""
    lines = ["{", ".reg .b32 s;", f"lop3.b32 $0, $4, 0x000F000F, {magic:#x}, 0xEA;"]
    for j in (1, 2, 3):
        lines += [f"shr.u32 s, $4, {4 * j};", f"lop3.b32 ${j}, s, 0x000F000F, {magic:#x}, 0xEA;"]
    lines += [f"{sub} ${j}, ${j}, $6;" for j in range(4)]
    return "\n".join([*lines, "}"])


DEQ_BF16 = tl.constexpr(_dequant_asm(0x43004300, "sub.rn.bf16x2"))
DEQ_F16 = tl.constexpr(_dequant_asm(0x64006400, "sub.rn.f16x2"))


@triton.jit
def dequant_planes(qq, z, USE_ASM: tl.constexpr, DT: tl.constexpr):
    """qq int32 [R, C] (column c: word c // 2 of a row's words), z int32 zeros [R, 1] -> the 4
    planes [R, C] in DT: column c of plane j is code (j + 4 * (c % 2)) - zero."""
    if USE_ASM:
        if DT == tl.bfloat16:
            zz = (z | 0x4300) * 65537
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                DEQ_BF16, "=r,=r,=r,=r,r,r,r,r", [qq, tl.broadcast_to(zz, qq.shape)],
                dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
        else:
            zz = (z | 0x6400) * 65537
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                DEQ_F16, "=r,=r,=r,=r,r,r,r,r", [qq, tl.broadcast_to(zz, qq.shape)],
                dtype=(tl.float16,) * 4, is_pure=True, pack=2)
    else:
        h16 = 16 * (tl.arange(0, qq.shape[1]) % 2)[None, :]
        w0 = (((qq >> h16) & 15) - z).to(tl.float32).to(DT)
        w1 = (((qq >> (h16 + 4)) & 15) - z).to(tl.float32).to(DT)
        w2 = (((qq >> (h16 + 8)) & 15) - z).to(tl.float32).to(DT)
        w3 = (((qq >> (h16 + 12)) & 15) - z).to(tl.float32).to(DT)
    return w0, w1, w2, w3


@triton.jit
def _plane_dot(acc, w, x_rows, xk, perm_ptr, m_ok, HAS_PERM: tl.constexpr,
               PRECISION: tl.constexpr, SWAP: tl.constexpr):
    """acc += x[:, xk] . w^T (act-order: x[:, perm[xk]]); SWAP: acc^T += w . x[:, xk]^T."""
    if HAS_PERM:
        xk = tl.load(perm_ptr + xk)
    x = tl.load(x_rows + xk[None, :], mask=m_ok[:, None], other=0.0)
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _marlin_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K,
    stride_xm, stride_q, stride_s, stride_om,
    GROUP: tl.constexpr,  # the group size, a multiple of BLOCK_K (constant: no division)
    HAS_PERM: tl.constexpr,
    USE_ASM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # 64, 128 or 256
    SPLIT_K: tl.constexpr,
    SWAP: tl.constexpr = False,  # weight rows as the MMA's M
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    BW: tl.constexpr = BLOCK_K // 8
    BQ: tl.constexpr = BLOCK_K // 4  # K of each plane's dot
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    rn_c = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N read row N - 1, never stored
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, steps)
    q_rows = q_ptr + rn_c[:, None] * stride_q + tl.arange(0, BW)[None, :]
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    c = tl.arange(0, BQ)
    xk = 64 * (c // 16) + c % 16  # plane 0's k of operand column c (plane j: + 16 j)
    DT = x_ptr.dtype.element_ty
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(first, last):
        q = tl.load(q_rows + step * BW)
        k0 = step * BLOCK_K
        grp = rn_c * stride_s + k0 // GROUP
        s = tl.load(s_ptr + grp).to(tl.float32)
        z = tl.load(z_ptr + grp).to(tl.int32)[:, None]
        qq = tl.reshape(tl.join(q, q), [BLOCK_N, BQ])  # column c: word c // 2
        w0, w1, w2, w3 = dequant_planes(qq, z, USE_ASM, DT)
        part = tl.zeros_like(acc)
        part = _plane_dot(part, w0, x_rows, k0 + xk, perm_ptr, m_ok, HAS_PERM, PRECISION,
                           SWAP)
        part = _plane_dot(part, w1, x_rows, k0 + xk + 16, perm_ptr, m_ok, HAS_PERM, PRECISION,
                           SWAP)
        part = _plane_dot(part, w2, x_rows, k0 + xk + 32, perm_ptr, m_ok, HAS_PERM, PRECISION,
                           SWAP)
        part = _plane_dot(part, w3, x_rows, k0 + xk + 48, perm_ptr, m_ok, HAS_PERM, PRECISION,
                           SWAP)
        if SWAP:
            acc += part * s[:, None]
        else:
            acc += part * s[None, :]
    if SWAP:
        offs = rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
        mask = m_ok[None, :] & n_ok[:, None]
    else:
        offs = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
    tile = pid_m * tl.num_programs(0) + pid_n
    split_k_store(acc, ws_ptr + offs, out_ptr + offs, mask, lock_ptr + tile, pid_k, M * N,
                  SPLIT_K)


# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, SWAP); BLOCK_M is the rows rounded up (16 .. 64).
# SWAP (weight rows as the MMA's M): on sm_90 a 64-row weight tile a warpgroup becomes wgmma
# with the dequantized planes as its register operand A and x read from shared memory by the
# MMA; sm_90 SASS of the loop at M = 16 (`python -m tests.quant.sm90_compile w4gemmloop`):
# 2.2-2.6 instructions a weight at BLOCK_K 256, 2.7-3.5 at 128 (LOP3/SHF/HSUB2 1.4 of them),
# against 4.2-5.3 with x as the MMA's M and 4.6-6.5 for kernels/w4a16_mma.py.
_TILES = [(bn, bk, sk, 4, 3, True) for bn in (64, 128) for bk in (128, 256)
          for sk in (1, 2, 4, 8)]
_TILES += [(64, 64, sk, 4, 3, True) for sk in (2, 4, 8)]  # groups of 64
_TILES += [(64, 128, 8, 4, 3, False), (64, 64, 8, 4, 3, False)]
_FALLBACK = triton.Config({"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "SWAP": True},
                          num_warps=4, num_stages=3)
MARLIN_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "SWAP": swap},
                                num_warps=w, num_stages=st)
                  for bn, bk, sk, w, st, swap in _TILES]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object
           ) -> list[triton.Config]:
    """Steps inside one group, at least one step per split, few enough split output tiles."""
    k, n, m = named_args["K"], named_args["N"], named_args["M"]
    g = int(kwargs["GROUP"])  # type: ignore[call-overload]
    ok = [c for c in configs if g % c.kwargs["BLOCK_K"] == 0
          and c.kwargs["SPLIT_K"] <= k // c.kwargs["BLOCK_K"]
          and (c.kwargs["SPLIT_K"] == 1 or triton.cdiv(n, c.kwargs["BLOCK_N"]) * m <= LOCKS)]
    return ok or [_FALLBACK]


_tuned = warmup_autotune(MARLIN_CONFIGS, ["N", "K", "M"],
                         prune_configs_by={"early_config_prune": _prune})(_marlin_kernel)


def marlin_ok(k: int, group_size: int) -> bool:
    """Shapes the re-packed layout takes: K and the group multiples of 64."""
    return k % BLOCK == 0 and group_size % BLOCK == 0


def w4a16_marlin(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None,
                 config: dict | None = None) -> torch.Tensor:
    """x2 [M, K] -> [M, N] in x2's dtype over marlin_pack'ed qweight (scales / zeros / perm as
    kernels/w4a16.py). On CUDA without `config` the tile is autotuned (up to MAX_TUNED_M rows);
    `config` (BLOCK_N, BLOCK_K, SPLIT_K, SWAP, num_warps, num_stages) pins one (tests, the
    interpreter, benchmarks)."""
    m, k = x2.shape
    n = qweight.shape[0]
    bm = min(64, max(16, triton.next_power_of_2(m)))
    tune = x2.is_cuda and not INTERPRET and config is None and m <= MAX_TUNED_M
    if x2.is_cuda and not INTERPRET and config is None and not tune:  # prefill: one tile
        config = {"BLOCK_N": 128, "BLOCK_K": 128 if group_size % 128 == 0 else 64,
                  "SWAP": True, "num_warps": 8}
    split = SPLIT_MAX if tune else (config or {}).get("SPLIT_K", 1)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    ws = torch.empty(split * m * n if split > 1 else 1, dtype=torch.float32, device=x2.device)
    locks = lock_buffer(x2.device)
    args = (x2, qweight, scales, zeros, qweight if perm is None else perm, out, ws, locks,
            m, n, k, x2.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
    asm = x2.is_cuda and not INTERPRET and x2.dtype in (torch.bfloat16, torch.float16)
    meta = dict(GROUP=group_size, HAS_PERM=perm is not None, USE_ASM=asm,
                PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", BLOCK_M=bm)
    if tune:
        def grid(a: dict) -> tuple[int, int, int]:
            return triton.cdiv(n, a["BLOCK_N"]), a["SPLIT_K"], triton.cdiv(m, bm)
        _tuned[grid](*args, **meta)
        return out
    c = {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3,
         "SWAP": True, **(config or {})}
    if group_size % c["BLOCK_K"] or k % c["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {c['BLOCK_K']} must divide the group {group_size} and K={k}")
    if c["SPLIT_K"] > 1 and triton.cdiv(n, c["BLOCK_N"]) * triton.cdiv(m, bm) > LOCKS:
        raise ValueError("too many output tiles for the split-K counters")
    _marlin_kernel[(triton.cdiv(n, c["BLOCK_N"]), c["SPLIT_K"], triton.cdiv(m, bm))](
        *args, **meta, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT_K=c["SPLIT_K"],
        SWAP=c["SWAP"], num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out
