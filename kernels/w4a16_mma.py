"""4-bit x 16-bit batched-decode GEMM on tensor cores, for 2-64 rows (GPTQ / AWQ after loading).

The layout is kernels/w4a16.py's: word w of weight row n holds k = 8w .. 8w + 7, weight 8w + i
in bits 4i .. 4i + 3. The general GEMM there rebuilds each [BLOCK_N, BLOCK_K] weight tile in K
order (joins and a reshape: register shuffles through shared memory on a GPU), which made 4-bit
batch-16 decode no faster than bf16. Here the K order is never rebuilt: the dot product does not
care in which order K is summed, so nibble i of a [BLOCK_N, BLOCK_K / 8] word tile is its own
tensor-core operand, multiplied by the x columns it belongs to (k = 8w + i: a stride-8 gather
of x, which is small and sits in L1):

    acc += W_i [BLOCK_N, BLOCK_K / 8] . x[:, i::8]^T     for i = 0 .. 7

Every step from the loaded words to the dot operand is elementwise (mask, one PRMT a code as in
kernels/code_floats.py, one FMA with the group's scale and zero, a cast), so the compiler keeps
the dequantized weights in the MMA's register layout. The weight rows are the MMA's M dimension
(swap-AB: N fills the 64-row tensor-core tile, the few x rows its N), and the few output tiles
of a narrow matrix are spread over split-K programs that finish in the same launch
(kernels/split_k.py). Tiles and split are autotuned per (N, K, group, M) before CUDA-graph
capture, as the decode GEMVs are (kernels/tuning.py).
"""

from __future__ import annotations

import torch

from flotilla.kernels.code_floats import INTERPRET, codes4
from flotilla.kernels.split_k import LOCKS, lock_buffer, split_k_store
from flotilla.kernels.triton_compat import tl, triton
from flotilla.kernels.tuning import warmup_autotune

MMA_MAX_M = 64  # rows this kernel serves; more go to the K-order GEMM (kernels/w4a16.py)
SPLIT_MAX = 8


@triton.jit
def _nibble_dot(acc, f, a, b, x_rows, kk, perm_ptr, m_ok, nib: tl.constexpr,
                HAS_PERM: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
                SWAP: tl.constexpr):
    """acc += dequantized nibble `nib` of the word tile . its x columns (k = kk + nib, or
    perm[k] under act-order): [BLOCK_N, BLOCK_M] (SWAP: the weight rows are the MMA's M) or
    [BLOCK_M, BLOCK_N]."""
    w = (f * a - b).to(DT)  # (code - zero) * scale, from f = 0.5 + code / 256
    k = kk + nib
    if HAS_PERM:
        k = tl.load(perm_ptr + k)
    x = tl.load(x_rows + k[:, None], mask=m_ok, other=0.0)  # [BLOCK_W, BLOCK_M]
    if SWAP:
        acc = tl.dot(w, x, acc, input_precision=PRECISION)
    else:
        acc = tl.dot(tl.trans(x), tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _tile_dot(acc, f, a, b, xj, DT: tl.constexpr, PRECISION: tl.constexpr,
              SWAP: tl.constexpr):
    """As _nibble_dot, with the nibble's x columns xj [BLOCK_M, BLOCK_W] already split out of
    one contiguous x tile."""
    w = (f * a - b).to(DT)
    if SWAP:
        acc = tl.dot(w, tl.trans(xj), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(xj, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _mma_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K,
    stride_xm, stride_q, stride_s, stride_om,
    group_size,
    HAS_PERM: tl.constexpr,
    SCALE_PER_WORD: tl.constexpr,  # groups shorter than BLOCK_K: a scale per word, not per row
    USE_ASM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # 128 or 256: BLOCK_K / 8 >= 16 words, the MMA's K
    SPLIT_K: tl.constexpr,
    SWAP: tl.constexpr = True,
    X_TILE: tl.constexpr = False,  # x as one [BLOCK_M, BLOCK_K] load split into nibble planes
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    BW: tl.constexpr = BLOCK_K // 8
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = (rm < M)[None, :]
    rn_c = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N read row N - 1, never stored
    offs_w = tl.arange(0, BW)
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, steps)
    q_rows = q_ptr + rn_c[:, None] * stride_q + offs_w[None, :]
    x_rows = x_ptr + rm.to(tl.int64)[None, :] * stride_xm
    DT = x_ptr.dtype.element_ty
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(first, last):
        q = tl.load(q_rows + step * BW)
        k0 = step * BLOCK_K
        if SCALE_PER_WORD:
            grp = rn_c[:, None] * stride_s + (k0 + 8 * offs_w[None, :]) // group_size
        else:
            grp = rn_c * stride_s + k0 // group_size
        s = tl.load(s_ptr + grp).to(tl.float32)
        z = tl.load(z_ptr + grp).to(tl.float32)
        a = 256.0 * s
        b = (128.0 + z) * s
        if not SCALE_PER_WORD:
            a = a[:, None]
            b = b[:, None]
        kk = k0 + 8 * offs_w  # the k of nibble 0 of each word
        f0, f2, f4, f6 = codes4(q & 0x0F0F0F0F, USE_ASM)
        f1, f3, f5, f7 = codes4((q >> 4) & 0x0F0F0F0F, USE_ASM)
        if X_TILE and not HAS_PERM:  # word w's 8 x values in one thread: splits move no data
            xt = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + k0
                         + tl.arange(0, BLOCK_K)[None, :], mask=tl.trans(m_ok), other=0.0)
            xe, xo = tl.split(tl.reshape(xt, [BLOCK_M, BW, 2, 2, 2]))
            xe0, xe1 = tl.split(xe)
            xo0, xo1 = tl.split(xo)
            x0, x4 = tl.split(xe0)
            x2, x6 = tl.split(xe1)
            x1, x5 = tl.split(xo0)
            x3, x7 = tl.split(xo1)
            acc = _tile_dot(acc, f0, a, b, x0, DT, PRECISION, SWAP)
            acc = _tile_dot(acc, f1, a, b, x1, DT, PRECISION, SWAP)
            acc = _tile_dot(acc, f2, a, b, x2, DT, PRECISION, SWAP)
            acc = _tile_dot(acc, f3, a, b, x3, DT, PRECISION, SWAP)
            acc = _tile_dot(acc, f4, a, b, x4, DT, PRECISION, SWAP)
            acc = _tile_dot(acc, f5, a, b, x5, DT, PRECISION, SWAP)
            acc = _tile_dot(acc, f6, a, b, x6, DT, PRECISION, SWAP)
            acc = _tile_dot(acc, f7, a, b, x7, DT, PRECISION, SWAP)
        else:  # each nibble's x columns gathered (stride 8, or through perm)
            acc = _nibble_dot(acc, f0, a, b, x_rows, kk, perm_ptr, m_ok, 0, HAS_PERM, DT,
                              PRECISION, SWAP)
            acc = _nibble_dot(acc, f1, a, b, x_rows, kk, perm_ptr, m_ok, 1, HAS_PERM, DT,
                              PRECISION, SWAP)
            acc = _nibble_dot(acc, f2, a, b, x_rows, kk, perm_ptr, m_ok, 2, HAS_PERM, DT,
                              PRECISION, SWAP)
            acc = _nibble_dot(acc, f3, a, b, x_rows, kk, perm_ptr, m_ok, 3, HAS_PERM, DT,
                              PRECISION, SWAP)
            acc = _nibble_dot(acc, f4, a, b, x_rows, kk, perm_ptr, m_ok, 4, HAS_PERM, DT,
                              PRECISION, SWAP)
            acc = _nibble_dot(acc, f5, a, b, x_rows, kk, perm_ptr, m_ok, 5, HAS_PERM, DT,
                              PRECISION, SWAP)
            acc = _nibble_dot(acc, f6, a, b, x_rows, kk, perm_ptr, m_ok, 6, HAS_PERM, DT,
                              PRECISION, SWAP)
            acc = _nibble_dot(acc, f7, a, b, x_rows, kk, perm_ptr, m_ok, 7, HAS_PERM, DT,
                              PRECISION, SWAP)
    if SWAP:
        offs = rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
        mask = n_ok[:, None] & m_ok
    else:
        offs = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        mask = n_ok[None, :] & tl.trans(m_ok)
    tile = pid_m * tl.num_programs(0) + pid_n
    split_k_store(acc, ws_ptr + offs, out_ptr + offs, mask, lock_ptr + tile, pid_k, M * N,
                  SPLIT_K)


# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, SWAP, X_TILE); BLOCK_M is the rows rounded up
# (16 .. 64). An H100 sweep at M = 16 over Llama-3-8B's matrices (bench/w4a16_batched.py
# --sweep) put x as the MMA's M (SWAP off) with 64-row weight tiles first everywhere: split 8
# for the narrow qkv / o / down, 2 for gate_up.
_TILES = [(bn, bk, sk, w, 3, swap, xt)
          for bn, w in ((64, 4), (128, 8)) for bk in (128, 256) for sk in (1, 2, 4, 8)
          for swap, xt in ((False, False), (False, True)) if not (bk == 256 and bn == 128)]
_TILES += [(64, 128, 8, 4, 3, True, False), (128, 128, 1, 4, 3, True, False)]
MMA_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "SWAP": swap,
                              "X_TILE": xt}, num_warps=w, num_stages=st)
               for bn, bk, sk, w, st, swap, xt in _TILES]


def _prune(configs: list[triton.Config], named_args: dict, **_: object) -> list[triton.Config]:
    """Tiles whose BLOCK_K divides K, with at least one step per split."""
    k = named_args["K"]
    ok = [c for c in configs if k % c.kwargs["BLOCK_K"] == 0
          and c.kwargs["SPLIT_K"] <= k // c.kwargs["BLOCK_K"]]
    return ok or configs[:1]


_per_word = triton.heuristics({"SCALE_PER_WORD": lambda a: a["group_size"] % a["BLOCK_K"] != 0})
_tuned = warmup_autotune(MMA_CONFIGS, ["N", "K", "group_size", "M"],
                         prune_configs_by={"early_config_prune": _prune})(_per_word(_mma_kernel))
_fixed = _per_word(_mma_kernel)


def mma_ok(x2: torch.Tensor, k: int, group_size: int) -> bool:
    """Shapes this kernel takes: 2..64 rows, K a multiple of 128, groups a multiple of 8 that
    divide 128 or are divided by it (per-channel groups included)."""
    return (2 <= x2.shape[0] <= MMA_MAX_M and k % 128 == 0
            and (group_size % 128 == 0 or 128 % group_size == 0) and group_size % 8 == 0)


def w4a16_mma(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None,
              config: dict | None = None) -> torch.Tensor:
    """x2 [M, K] (2..64 rows) -> [M, N] in x2's dtype; arguments checked by kernels/w4a16.py.
    On CUDA without `config` the tile is autotuned; `config` (BLOCK_N, BLOCK_K, SPLIT_K,
    num_warps, num_stages) pins one (tests, the interpreter, benchmarks)."""
    m, k = x2.shape
    n = qweight.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    ws = torch.empty(SPLIT_MAX * m * n, dtype=torch.float32, device=x2.device)
    locks = lock_buffer(x2.device)
    args = (x2, qweight, scales, zeros, qweight if perm is None else perm, out, ws, locks,
            m, n, k, x2.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
            group_size)
    meta = dict(HAS_PERM=perm is not None, USE_ASM=x2.is_cuda and not INTERPRET,
                PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", BLOCK_M=bm)
    if x2.is_cuda and config is None:
        def grid(a: dict) -> tuple[int, int, int]:
            return triton.cdiv(n, a["BLOCK_N"]), a["SPLIT_K"], triton.cdiv(m, bm)
        _tuned[grid](*args, **meta)
        return out
    c = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2,
         "SWAP": True, "X_TILE": False, **(config or {})}
    if c["BLOCK_K"] % 128 or k % c["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {c['BLOCK_K']} must be a multiple of 128 dividing K={k}")
    if triton.cdiv(n, c["BLOCK_N"]) * triton.cdiv(m, bm) > LOCKS:
        raise ValueError("too many output tiles for the split-K counters")
    _fixed[(triton.cdiv(n, c["BLOCK_N"]), c["SPLIT_K"], triton.cdiv(m, bm))](
        *args, **meta, BLOCK_N=c["BLOCK_N"],
        BLOCK_K=c["BLOCK_K"], SPLIT_K=c["SPLIT_K"], SWAP=c["SWAP"], X_TILE=c["X_TILE"],
        num_warps=c["num_warps"],
        num_stages=c["num_stages"])
    return out
