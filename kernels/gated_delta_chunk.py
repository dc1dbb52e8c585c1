"""Gated DeltaNet chunked prefill over packed variable-length sequences (Triton).

Chunks of BT = 64 tokens start at each sequence's first token (kernels/gated_delta_torch.py has
the math). Three launches:
1. `_chunk_prepare_kernel`, one program per (chunk, value head), all chunks in parallel: the
   in-chunk cumulative log decay G, the strictly lower A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j),
   T = (I + A)^-1 (the UT transform; `_unit_lower_inverse`: 16x16 diagonal blocks by forward
   substitution, then joined by four dots), then w = T (beta exp(G) k) and u = T (beta v) with
   tensor-core dots. Writes G [T, Hv], w [T, Hv, Dk], u [T, Hv, Dv] (fp32 scratch).
2. `_chunk_state_kernel`, one program per (sequence, value head, block of BV value columns),
   walking its sequence's chunks in order with the [Dk, BV] state slice S in registers: stores
   S as the chunk's starting state h, v_new = u - w S (over u, in place), then
   S = exp(G_last) S + (exp(G_last - G) k)^T v_new. Columns of the state are independent, so
   the Dv split needs no communication. This is the only sequential part.
3. `_chunk_output_kernel`, one program per (chunk, value head, block of value columns), all in
   parallel: o = exp(G) (q h) + causal((q k^T) o exp(G_i - G_j)) v_new.
q and k are l2-normalised by each kernel that reads them (not stored). All math in fp32;
dots of fp32 tiles use tensor cores: the UT transform at about fp32 accuracy ("tf32x3"), the
state walk and output in `precision` ("tf32" by default: 10-bit mantissas into fp32 sums, finer
than bf16 inputs; "tf32x3" needs more registers than an H100 has for these tiles and spills;
"ieee" for checks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flotilla.kernels.triton_compat import tl, triton

BT = 64  # chunk length: transformers' chunk_size


class SequenceChunks(NamedTuple):
    sequence: torch.Tensor  # int32 [C]: the sequence each chunk belongs to
    start: torch.Tensor  # int32 [C]: the chunk's first token
    first: torch.Tensor  # int32 [N]: each sequence's first chunk


def sequence_chunks(cu_seqlens: torch.Tensor, block: int) -> SequenceChunks:
    """Chunks of `block` tokens from each sequence's start (one host sync on cu_seqlens)."""
    cu = cu_seqlens.to("cpu", torch.int64)
    counts = (cu[1:] - cu[:-1] + block - 1) // block
    seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    first = torch.cumsum(counts, 0) - counts
    start = cu[:-1][seq] + (torch.arange(seq.numel()) - first[seq]) * block
    device = cu_seqlens.device
    return SequenceChunks(
        seq.to(device, torch.int32), start.to(device, torch.int32), first.to(device, torch.int32)
    )


@triton.jit
def _load_keys(
    ptr, rows, mask_rows, head, stride_t, stride_h, offs_k, mask_k, USE_L2: tl.constexpr
):
    """[BT, BK] fp32 rows of one head, l2-normalised when USE_L2 (padding rows are zero)."""
    x = tl.load(
        ptr + rows[:, None] * stride_t + head * stride_h + offs_k[None, :],
        mask=mask_rows[:, None] & mask_k[None, :],
        other=0.0,
    ).to(tl.float32)
    if USE_L2:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _unit_lower_inverse(a, idx, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """(I + a)^-1 for a strictly lower [CHUNK, CHUNK] tile, CHUNK a multiple of 16.

    The 16x16 diagonal blocks first, all four at once: forward substitution, step r finishing
    row r of every block as I - A_diag T from the rows above it (15 dots). Then, with
    I + A = (I + A_diag)(I + N), N = T_diag A_off strictly block-lower (N^(CHUNK/16) = 0):
    (I + A)^-1 = (I - N (I - N (I - N))) T_diag, nested so no partial sum grows past the
    inverse's own entries."""
    i = idx[:, None]
    j = idx[None, :]
    eye = tl.where(i == j, 1.0, 0.0)
    same_block = (i // 16) == (j // 16)
    a_diag = tl.where(same_block, a, 0.0)
    t = eye
    for r in range(1, 16):
        step = eye - tl.dot(a_diag, t, input_precision=PRECISION)
        t = tl.where((i % 16) == r, step, t)
    n = tl.dot(t, tl.where(same_block, 0.0, a), input_precision=PRECISION)
    p = eye - n
    for _ in tl.static_range(CHUNK // 16 - 2):
        p = eye - tl.dot(n, p, input_precision=PRECISION)
    return tl.dot(p, t, input_precision=PRECISION)


@triton.jit
def _chunk_prepare_kernel(
    k_ptr,  # [T, Hk, Dk] keys (last dim contiguous)
    v_ptr,  # [T, Hv, Dv] values
    g_ptr,  # [T, Hv] log decay
    beta_ptr,  # [T, Hv]
    chunk_seq_ptr,  # int32 [C] sequence of each chunk
    chunk_start_ptr,  # int32 [C] first token of each chunk
    cu_ptr,  # int32 [N+1] sequence bounds
    gcum_ptr,  # out [T, Hv] fp32: cumulative log decay within the chunk
    w_ptr,  # out [T, Hv, Dk] fp32
    u_ptr,  # out [T, Hv, Dv] fp32
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GROUP: tl.constexpr,  # Hv // Hk
    BK: tl.constexpr,  # next power of two >= Dk
    BV: tl.constexpr,  # value columns per dot
    CHUNK: tl.constexpr,  # BT
    USE_L2: tl.constexpr,
    PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    hv = tl.program_id(1)
    start = tl.load(chunk_start_ptr + c)
    end = tl.load(cu_ptr + tl.load(chunk_seq_ptr + c) + 1)
    idx = tl.arange(0, CHUNK)
    rows = (start + idx).to(tl.int64)
    mask_rows = rows < end
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < DK
    k = _load_keys(
        k_ptr, rows, mask_rows, hv // GROUP, stride_kt, stride_kh, offs_k, mask_k, USE_L2
    )
    g = tl.load(g_ptr + rows * stride_gt + hv, mask=mask_rows, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_bt + hv, mask=mask_rows, other=0.0).to(tl.float32)
    gcum = tl.cumsum(g, axis=0)
    tl.store(gcum_ptr + rows * HV + hv, gcum, mask=mask_rows)

    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    lower = idx[:, None] > idx[None, :]
    decay = tl.exp(tl.where(lower, gcum[:, None] - gcum[None, :], 0.0))
    t = _unit_lower_inverse(tl.where(lower, beta[:, None] * kk * decay, 0.0), idx, CHUNK, PRECISION)

    # k again (an L2 hit) rather than kept live across the inverse: registers, not bandwidth
    k = _load_keys(
        k_ptr, rows, mask_rows, hv // GROUP, stride_kt, stride_kh, offs_k, mask_k, USE_L2
    )
    kg = k * (beta * tl.exp(gcum))[:, None]
    w = tl.dot(t, kg, input_precision=PRECISION)
    out_rows = rows[:, None] * HV + hv
    tl.store(w_ptr + out_rows * DK + offs_k[None, :], w, mask=mask_rows[:, None] & mask_k[None, :])
    for v0 in tl.static_range(0, DV, BV):
        offs_v = v0 + tl.arange(0, BV)
        mask = mask_rows[:, None] & (offs_v < DV)[None, :]
        v = tl.load(
            v_ptr + rows[:, None] * stride_vt + hv * stride_vh + offs_v[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        u = tl.dot(t, v * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + out_rows * DV + offs_v[None, :], u, mask=mask)


@triton.jit
def _chunk_state_kernel(
    k_ptr,  # [T, Hk, Dk] keys (last dim contiguous)
    gcum_ptr,  # [T, Hv] fp32 from _chunk_prepare_kernel
    w_ptr,  # [T, Hv, Dk] fp32
    u_ptr,  # [T, Hv, Dv] fp32: u in, v_new out (this program's columns only)
    cu_ptr,  # int32 [N+1]
    first_ptr,  # int32 [N] each sequence's first chunk
    init_ptr,  # [N, Hv, Dk, Dv] fp32 initial states (read when HAS_INIT)
    h_ptr,  # out [C, Hv, Dk, Dv] fp32: the state at each chunk's start
    final_ptr,  # out [N, Hv, Dk, Dv] fp32
    stride_kt,
    stride_kh,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GROUP: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,  # value columns per program
    CHUNK: tl.constexpr,
    HAS_INIT: tl.constexpr,
    USE_L2: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n = tl.program_id(0)
    hv = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_v = offs_v < DV
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < DK
    tile = offs_k[:, None] * DV + offs_v[None, :]
    s_mask = mask_k[:, None] & mask_v[None, :]
    s_offs = (n.to(tl.int64) * HV + hv) * DK * DV + tile
    if HAS_INIT:
        s = tl.load(init_ptr + s_offs, mask=s_mask, other=0.0)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    chunk = tl.load(first_ptr + n).to(tl.int64)
    idx = tl.arange(0, CHUNK)
    for lo in range(bos, eos, CHUNK):
        tl.store(h_ptr + (chunk * HV + hv) * DK * DV + tile, s, mask=s_mask)
        rows = (lo + idx).to(tl.int64)
        mask_rows = rows < eos
        w = tl.load(
            w_ptr + (rows[:, None] * HV + hv) * DK + offs_k[None, :],
            mask=mask_rows[:, None] & mask_k[None, :],
            other=0.0,
        )
        u_ptrs = u_ptr + (rows[:, None] * HV + hv) * DV + offs_v[None, :]
        mask_u = mask_rows[:, None] & mask_v[None, :]
        v_new = tl.load(u_ptrs, mask=mask_u, other=0.0) - tl.dot(w, s, input_precision=PRECISION)
        tl.store(u_ptrs, v_new, mask=mask_u)
        gcum = tl.load(gcum_ptr + rows * HV + hv, mask=mask_rows, other=0.0)
        g_last = tl.load(gcum_ptr + (tl.minimum(lo + CHUNK, eos) - 1).to(tl.int64) * HV + hv)
        k = _load_keys(
            k_ptr, rows, mask_rows, hv // GROUP, stride_kt, stride_kh, offs_k, mask_k, USE_L2
        )
        k = k * tl.exp(g_last - gcum)[:, None]
        s = s * tl.exp(g_last) + tl.dot(tl.trans(k), v_new, input_precision=PRECISION)
        chunk += 1
    tl.store(final_ptr + s_offs, s, mask=s_mask)


@triton.jit
def _chunk_output_kernel(
    q_ptr,  # [T, Hk, Dk] queries (last dim contiguous)
    k_ptr,  # [T, Hk, Dk] keys
    gcum_ptr,  # [T, Hv] fp32
    v_new_ptr,  # [T, Hv, Dv] fp32 from _chunk_state_kernel
    h_ptr,  # [C, Hv, Dk, Dv] fp32 each chunk's starting state
    chunk_seq_ptr,  # int32 [C]
    chunk_start_ptr,  # int32 [C]
    cu_ptr,  # int32 [N+1]
    o_ptr,  # out [T, Hv, Dv], contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    scale,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GROUP: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_L2: tl.constexpr,
    PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_v = offs_v < DV
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < DK
    start = tl.load(chunk_start_ptr + c)
    end = tl.load(cu_ptr + tl.load(chunk_seq_ptr + c) + 1)
    idx = tl.arange(0, CHUNK)
    rows = (start + idx).to(tl.int64)
    mask_rows = rows < end
    gcum = tl.load(gcum_ptr + rows * HV + hv, mask=mask_rows, other=0.0)
    q = _load_keys(q_ptr, rows, mask_rows, hk, stride_qt, stride_qh, offs_k, mask_k, USE_L2)
    k = _load_keys(k_ptr, rows, mask_rows, hk, stride_kt, stride_kh, offs_k, mask_k, USE_L2)
    q = q * scale
    causal = idx[:, None] >= idx[None, :]
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    qk = tl.where(causal, qk * tl.exp(tl.where(causal, gcum[:, None] - gcum[None, :], 0.0)), 0.0)
    h = tl.load(
        h_ptr + (c.to(tl.int64) * HV + hv) * DK * DV + offs_k[:, None] * DV + offs_v[None, :],
        mask=mask_k[:, None] & mask_v[None, :],
        other=0.0,
    )
    mask_o = mask_rows[:, None] & mask_v[None, :]
    v_new = tl.load(
        v_new_ptr + (rows[:, None] * HV + hv) * DV + offs_v[None, :], mask=mask_o, other=0.0
    )
    o = tl.dot(q * tl.exp(gcum)[:, None], h, input_precision=PRECISION)
    o += tl.dot(qk, v_new, input_precision=PRECISION)
    tl.store(
        o_ptr + (rows[:, None] * HV + hv) * DV + offs_v[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=mask_o,
    )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def chunk_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm: bool,
    precision: str = "tf32",
    block_v_state: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The three launches; shapes checked by kernels/gated_delta.py. Scratch: G, w, u/v_new
    per token and value head, one state per chunk and value head (all fp32)."""
    total, hk, dk = q.shape
    hv, dv = v.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    g, beta = _rows_contiguous(g), _rows_contiguous(beta)
    device = q.device
    o = torch.empty(v.shape, dtype=v.dtype, device=device)
    final = torch.empty(num_seqs, hv, dk, dv, dtype=torch.float32, device=device)
    if num_seqs == 0:
        return o, final
    chunks = sequence_chunks(cu_seqlens, BT)
    num_chunks = chunks.start.numel()
    gcum = torch.empty(total, hv, dtype=torch.float32, device=device)
    w = torch.empty(total, hv, dk, dtype=torch.float32, device=device)
    u = torch.empty(total, hv, dv, dtype=torch.float32, device=device)
    h = torch.empty(num_chunks, hv, dk, dv, dtype=torch.float32, device=device)
    bk = max(triton.next_power_of_2(dk), 16)
    # the state walk: 32 columns a program (parallelism: N * Hv * Dv / 32 programs walk in
    # parallel); the output: 64 (fewer q k^T redone). All compile spill-free on sm_90 (16-64).
    bv_state = max(min(block_v_state, triton.next_power_of_2(dv)), 16)
    bv_out = max(min(64, triton.next_power_of_2(dv)), 16)
    common = dict(HV=hv, DK=dk, DV=dv, GROUP=hv // hk, BK=bk, CHUNK=BT, USE_L2=use_qk_l2norm)
    if num_chunks > 0:
        _chunk_prepare_kernel[(num_chunks, hv)](
            k, v, g, beta, chunks.sequence, chunks.start, cu_seqlens, gcum, w, u,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            BV=bv_state, PRECISION="ieee" if precision == "ieee" else "tf32x3", num_warps=4,
            **common,
        )  # fmt: skip
    init = initial_state.contiguous() if initial_state is not None else final
    _chunk_state_kernel[(num_seqs, hv, triton.cdiv(dv, bv_state))](
        k, gcum, w, u, cu_seqlens, chunks.first, init, h, final, k.stride(0), k.stride(1),
        BV=bv_state, HAS_INIT=initial_state is not None, PRECISION=precision, num_warps=8,
        **common,
    )  # fmt: skip
    if num_chunks > 0:
        _chunk_output_kernel[(num_chunks, hv, triton.cdiv(dv, bv_out))](
            q, k, gcum, u, h, chunks.sequence, chunks.start, cu_seqlens, o,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), scale,
            BV=bv_out, PRECISION=precision, num_warps=8, **common,
        )  # fmt: skip
    return o, final
