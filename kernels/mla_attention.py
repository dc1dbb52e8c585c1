"""Multi-head latent attention (DeepSeek-V2/V3) over the compressed paged cache, absorbed form.

The cache holds one entry per token, [kv_lora_rank latent c | rope_dim shared key k_pe]
([num_blocks, block_size, 1, R + P]). The caller absorbs W_UK into the query (q_lat = q_nope W_UK,
[T, H, R]) and applies W_UV to the output afterwards, so per head:
    scores = (q_lat . c + q_pe . k_pe) * scale,  out_lat = softmax(scores) . c   ([T, H, R]).
Every head shares the one cached entry (multi-query), so a program serves a block of heads (and,
in extend, a few query tokens of each) from every key tile it reads.

- Decode-only batches: split-KV (flash-decoding) kernel, grid (B, head blocks, splits); the
  splits are merged by paged_attention's reduce kernel.
- Any other batch (prefill / extend, q_len >= 1 rows mixed): the extend kernel, grid
  (B, head blocks, query-token blocks), causal over cache + new tokens (new token j of a
  sequence sits at position seq_len - q_len + j; its own entry is already in the cache).
"""

from __future__ import annotations

import torch

from flotilla.kernels.attention_metadata import AttentionMetadata
from flotilla.kernels.paged_attention import (
    _decode_reduce_kernel,
    default_num_splits,
    store_split_output,
)
from flotilla.kernels.prefill_attention import new_output
from flotilla.kernels.triton_compat import tl, triton

LOG2E = 1.4426950408889634


def mla_attention_ref(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Per-sequence dense reference in fp32: q_lat [T, H, R], q_pe [T, H, P],
    cache [N, bs, 1, R + P] -> out_lat [T, H, R] (rows of no sequence are zero)."""
    rank = q_lat.shape[-1]
    out = torch.zeros_like(q_lat)
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    block_size = cache.shape[1]
    for i, seq_len in enumerate(lens):
        lo, hi = qsl[i], qsl[i + 1]
        if hi == lo:
            continue
        blocks = meta.block_tables[i, : -(-seq_len // block_size)].long()
        entries = cache.index_select(0, blocks).flatten(0, 2)[:seq_len].float()  # [L, R + P]
        q = torch.cat([q_lat[lo:hi], q_pe[lo:hi]], dim=-1).float()  # [n, H, R + P]
        scores = torch.einsum("nhd,ld->nhl", q, entries) * scale
        q_pos = seq_len - (hi - lo) + torch.arange(hi - lo, device=q.device)
        hidden = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]
        probs = scores.masked_fill(hidden[:, None, :], float("-inf")).softmax(-1)
        out[lo:hi] = torch.einsum("nhl,lr->nhr", probs, entries[:, :rank]).to(out.dtype)
    return out


@triton.jit
def _mla_tile(
    acc, m_i, l_i,  # running output [M, BLOCK_R], row max [M], row sum [M] (log2 domain)
    q_lat, q_pe, q_pos,  # [M, BLOCK_R], [M, BLOCK_P], positions [M] (read when CAUSAL)
    start_n, hi,  # keys start_n .. start_n + BLOCK_N, valid below hi
    cache_ptr, table_ptr,  # cache base; this sequence's block-table row
    offs_r, r_mask, offs_p, p_mask,
    stride_cb, stride_ct, qk_scale,  # qk_scale = softmax scale * log2(e)
    RANK: tl.constexpr,  # kv_lora_rank: k_pe starts at this offset of an entry
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_N: tl.constexpr,  # the tile may reach past hi
    CAUSAL: tl.constexpr,  # the tile may hold keys after some query row
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over BLOCK_N cache entries; the latent serves as K and V."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hi
    if MASK_N:
        blk = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
    else:
        blk = tl.load(table_ptr + offs_n // BLOCK_SIZE)
    rows = blk.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct
    c = tl.load(cache_ptr + rows[:, None] + offs_r[None, :],
                mask=n_valid[:, None] & r_mask[None, :], other=0.0)
    k_pe = tl.load(cache_ptr + rows[:, None] + RANK + offs_p[None, :],
                   mask=n_valid[:, None] & p_mask[None, :], other=0.0)
    s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION) * qk_scale
    if MASK_N:
        s = tl.where(n_valid[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt"])  # see kernels/paged_attention.py
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr,  # [T, H, R], [T, H, P]; one row per sequence (query_start_loc[seq])
    cache_ptr,  # [num_blocks, BLOCK_SIZE, 1, R + P]
    out_ptr,  # NUM_SPLITS == 1: out_lat [T, H, R]; else partial fp32 [B, H, NUM_SPLITS, R]
    lse_ptr,  # fp32 [B, H, NUM_SPLITS] log2-sum-exp of each split (unused if NUM_SPLITS == 1)
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,  # int32 [B, max_blocks], [B], [B + 1]
    qk_scale,
    stride_lt, stride_lh, stride_pt, stride_ph,  # q_lat / q_pe (token, head) strides
    stride_cb, stride_ct,  # cache (block, token) strides
    stride_bt,
    stride_ot, stride_oh,  # of out_lat (NUM_SPLITS == 1)
    num_heads,
    RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program (>= 16, tl.dot's minimum M)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,  # RANK / ROPE padded to powers of two
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # The sequence's keys are cut into NUM_SPLITS ranges (rounded to BLOCK_N); a program reads
    # its range once for BLOCK_H heads. Empty ranges record lse = -inf.
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == row:
        return  # no new token for this sequence
    row = row.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < ROPE
    q_lat = tl.load(q_lat_ptr + row * stride_lt + heads[:, None] * stride_lh + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + row * stride_pt + heads[:, None] * stride_ph + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _mla_tile(
            acc, m_i, l_i, q_lat, q_pe, seq_len, start_n, hi, cache_ptr, table_ptr,
            offs_r, r_mask, offs_p, p_mask, stride_cb, stride_ct, qk_scale,
            RANK, BLOCK_SIZE, BLOCK_N, True, False, DOT_PRECISION,
        )
    store_split_output(acc, m_i, l_i, out_ptr, lse_ptr, row, seq, split, heads, h_mask, offs_r,
                       r_mask, stride_ot, stride_oh, num_heads, RANK, NUM_SPLITS)


@triton.jit(do_not_specialize=["stride_bt"])  # see kernels/paged_attention.py
def _mla_extend_kernel(
    q_lat_ptr, q_pe_ptr,  # [T, H, R], [T, H, P]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, 1, R + P]
    out_ptr,  # out_lat [T, H, R]
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale,
    stride_lt, stride_lh, stride_pt, stride_ph,
    stride_cb, stride_ct,
    stride_bt,
    stride_ot, stride_oh,
    num_heads,
    RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_T: tl.constexpr,  # query tokens per program; M = BLOCK_T * BLOCK_H rows (>= 16)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Row m of a program is (token m // BLOCK_H, head m % BLOCK_H) of its blocks. Keys before
    # the block's first query position are visible to every row and run unmasked; the rest
    # (the diagonal) are masked per row.
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    t_block = tl.num_programs(2) - 1 - tl.program_id(2)  # most keys first
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if t_block * BLOCK_T >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    offs_m = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = t_block * BLOCK_T + offs_m // BLOCK_H
    heads = head_block * BLOCK_H + offs_m % BLOCK_H
    m_mask = (tok < q_len) & (heads < num_heads)
    q_pos = ctx + tok
    rows = (q_start + tok).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < ROPE
    q_lat = tl.load(q_lat_ptr + rows[:, None] * stride_lt + heads[:, None] * stride_lh
                    + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + rows[:, None] * stride_pt + heads[:, None] * stride_ph
                   + offs_p[None, :], mask=m_mask[:, None] & p_mask[None, :], other=0.0)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first_pos = ctx + t_block * BLOCK_T
    hi = tl.minimum(first_pos + BLOCK_T, seq_len)
    mid = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys below mid: no causal mask
    m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_R], tl.float32)
    for start_n in range(0, mid, BLOCK_N):
        acc, m_i, l_i = _mla_tile(
            acc, m_i, l_i, q_lat, q_pe, q_pos, start_n, hi, cache_ptr, table_ptr,
            offs_r, r_mask, offs_p, p_mask, stride_cb, stride_ct, qk_scale,
            RANK, BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION,
        )
    for start_n in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _mla_tile(
            acc, m_i, l_i, q_lat, q_pe, q_pos, start_n, hi, cache_ptr, table_ptr,
            offs_r, r_mask, offs_p, p_mask, stride_cb, stride_ct, qk_scale,
            RANK, BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


def check_mla_args(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                   meta: AttentionMetadata) -> None:
    """Shape / dtype / layout contract of the MLA launchers."""
    if q_lat.dim() != 3 or q_pe.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(f"want q_lat [T, H, R], q_pe [T, H, P], cache [N, bs, 1, R + P]; got "
                         f"{tuple(q_lat.shape)}, {tuple(q_pe.shape)}, {tuple(cache.shape)}")
    if q_lat.shape[:2] != q_pe.shape[:2] or cache.shape[3] != q_lat.shape[2] + q_pe.shape[2]:
        raise ValueError(f"q_lat {tuple(q_lat.shape)} / q_pe {tuple(q_pe.shape)} do not fit "
                         f"cache {tuple(cache.shape)}")
    block_size = cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two")
    if not (q_lat.dtype == q_pe.dtype == cache.dtype):
        raise ValueError(f"dtypes differ: q_lat {q_lat.dtype}, q_pe {q_pe.dtype}, "
                         f"cache {cache.dtype}")
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("q_lat, q_pe and the cache must have a contiguous last dim")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or t.device != q_lat.device:
            raise ValueError(f"meta.{name} must be int32 on {q_lat.device}, got {t.dtype} "
                             f"{t.device}")
    if meta.block_tables.stride(-1) != 1:
        raise ValueError("meta.block_tables must have a contiguous last dim")


def mla_decode_triton(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, num_splits: int | None = None, block_h: int = 16, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int = 2,
) -> torch.Tensor:
    """Split-KV decode for batches where every sequence has at most one new token.

    Defaults (bf16, DeepSeek-V3 sizes R 512 / P 64, sm_90, tests/kernels/mla_sm90.py): 16 heads
    and BLOCK_N 32 keys a step with 8 warps and 2 stages use 124 registers, no spills (4 warps
    or BLOCK_N 64 spill or reach 255). One masked key loop: splitting off an unmasked main loop
    (as paged_attention's decode does) pushed this kernel to 255 registers. Not yet timed."""
    check_mla_args(q_lat, q_pe, cache, meta)
    if meta.max_query_len > 1:
        raise ValueError("mla_decode_triton needs q_len <= 1 for every sequence")
    num_seqs = meta.seq_lens.shape[0]
    num_heads, rank = q_lat.shape[1:]
    out = new_output(q_lat, meta)
    if num_seqs == 0:
        return out
    head_blocks = triton.cdiv(num_heads, block_h)
    num_splits = num_splits or default_num_splits(num_seqs, head_blocks, meta.max_seq_len)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits {num_splits} must be a power of two")
    fp32 = q_lat.dtype == torch.float32
    block_n = block_n or (16 if fp32 else 32)
    num_warps = num_warps or 8
    if num_splits == 1:
        partial = lse = out
    else:
        partial = torch.empty(num_seqs, num_heads, num_splits, rank, dtype=torch.float32,
                              device=q_lat.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                          device=q_lat.device)
    _mla_decode_kernel[(num_seqs, head_blocks, num_splits)](
        q_lat, q_pe, cache, partial, lse, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
        out.stride(0), out.stride(1), num_heads,
        RANK=rank, ROPE=q_pe.shape[2], BLOCK_H=block_h, BLOCK_SIZE=cache.shape[1],
        BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=triton.next_power_of_2(q_pe.shape[2]), NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if fp32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial, lse, out, meta.query_start_loc, lse, out.stride(0), out.stride(1),
            num_heads, rank, NUM_SPLITS=num_splits, BLOCK_D=triton.next_power_of_2(rank),
            num_warps=4,
        )
    return out


def mla_extend_triton(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, block_h: int = 16, block_t: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int = 2,
) -> torch.Tensor:
    """Any mix of q_len >= 1 sequences, causal. Grid (B, head blocks, query-token blocks).

    Defaults (bf16, R 512 / P 64, sm_90): 2 tokens x 16 heads = 32 rows a program, BLOCK_N 32,
    8 warps, 2 stages: 200 registers, no spills (4 tokens spill). The absorbed form costs
    R + P + R multiply-adds per (query, key, head) against 2 * 128 + 64 for attention over
    decompressed keys: fine for chunked extends and short prompts, slower for long first
    prefills (a decompressing prefill kernel would be the next step). Not yet timed."""
    check_mla_args(q_lat, q_pe, cache, meta)
    num_seqs = meta.seq_lens.shape[0]
    num_heads, rank = q_lat.shape[1:]
    out = new_output(q_lat, meta)
    if num_seqs == 0 or meta.max_query_len == 0:
        return out
    fp32 = q_lat.dtype == torch.float32
    block_t = block_t or (1 if fp32 else 2)
    block_t = min(block_t, triton.next_power_of_2(meta.max_query_len))
    block_h = max(block_h, 16 // block_t)
    block_n = block_n or (16 if fp32 else 32)
    num_warps = num_warps or 8
    grid = (num_seqs, triton.cdiv(num_heads, block_h), triton.cdiv(meta.max_query_len, block_t))
    _mla_extend_kernel[grid](
        q_lat, q_pe, cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
        out.stride(0), out.stride(1), num_heads,
        RANK=rank, ROPE=q_pe.shape[2], BLOCK_H=block_h, BLOCK_T=block_t,
        BLOCK_SIZE=cache.shape[1], BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=triton.next_power_of_2(q_pe.shape[2]),
        DOT_PRECISION="ieee" if fp32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
    return out


def mla_attention_triton(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Decode-only batches -> split-KV decode kernel; anything else -> extend kernel."""
    fn = mla_decode_triton if meta.is_decode_only else mla_extend_triton
    return fn(q_lat, q_pe, cache, meta, scale)
