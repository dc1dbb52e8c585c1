"""The split-KV (flash-decoding) decode kernel of paged attention: decode-only batches (every
sequence has one new token), its split merge (`_decode_reduce_kernel`, also MLA's) and the split
count (`default_num_splits`). With `kv_scales` the caches are e4m3 (kernels/kv_quant.py),
dequantized inside the tiles. With `sinks` [Hq] (gpt-oss's learned attention sinks) each head's
sink logit joins the softmax denominator: folded into the output of a one-split decode, into the
split merge otherwise. kernels/paged_attention.py is the entry point (and re-exports these)."""

from __future__ import annotations

import torch

from flotilla.kernels.attention_metadata import AttentionMetadata
from flotilla.kernels.attention_tile import LOG2E, attend_tile, fold_sink
from flotilla.kernels.kv_quant import KVScales
from flotilla.kernels.pdl import pdl_args, pdl_wait
from flotilla.kernels.prefill_attention import (
    check_attention_args,
    new_output,
    window_arg,
)
from flotilla.kernels.triton_compat import tl, triton

# default_num_splits: contexts up to SHORT_SPLIT_KEYS keys get latency-sized splits, and one
# split once a launch has ONE_SPLIT_PROGRAMS (sequence, KV head) programs (~ the SM count).
SHORT_SPLIT_KEYS = 512
ONE_SPLIT_PROGRAMS = 128


# stride_bt (the block table's row stride) is the step's longest sequence in blocks: Triton would
# specialise it (divisible by 16 or not, or 1), compiling a new variant mid-serving the first
# time a step crosses into another class (a ~1 s stall); these kernels take it unspecialised.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr,  # [T, Hq, D] one query row per sequence (row = query_start_loc[seq])
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hk, D]
    k_scale_ptr, v_scale_ptr,  # KV_FP8: fp32 [num_blocks * BLOCK_SIZE, Hk] (else unused)
    out_ptr,  # NUM_SPLITS == 1: final output [T, Hq, D]; else partial fp32 [B, Hq, NUM_SPLITS, D]
    lse_ptr,  # fp32 [B, Hq, NUM_SPLITS] log2-sum-exp of each split (unused if NUM_SPLITS == 1)
    sinks_ptr,  # USE_SINKS: [Hq] attention-sink logits, folded here when NUM_SPLITS == 1
    block_tables_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    query_start_loc_ptr,  # int32 [B + 1]
    sm_scale, softcap, window,
    stride_qt, stride_qh,
    stride_cb, stride_ct, stride_ch,  # cache strides (block, token, head), same for K and V
    stride_bt,
    stride_ot, stride_oh,  # of the final output (NUM_SPLITS == 1)
    num_q_heads,
    num_kv_heads,  # Hk: the scales' stride per slot
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # Hq // Hk: query heads sharing this program's KV head
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum M)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # e4m3 caches with per-(token, head) scales
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py)
    USE_SINKS: tl.constexpr = False,
    CHUNKED: tl.constexpr = False,  # USE_WINDOW is chunked attention, `window` the chunk size
):
    # Grid (B, Hk, NUM_SPLITS): the visible keys of a sequence are cut into NUM_SPLITS equal
    # ranges (rounded to BLOCK_N); each program reads its range of one KV head once and serves
    # all GROUP query heads from it. Empty ranges (short sequences) record lse = -inf.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + seq)
    next_row = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # the step's metadata (host copies before the graph) is read before the wait; q and the
    # KV cache (the rotary kernel's writes) after it
    pdl_wait(USE_PDL)
    # Return when the sequence has no new token. `seq_len < 0` never holds: testing it keeps the
    # seq_len load above the branch, issued with the query_start_loc loads (LLVM otherwise sinks
    # it below: one more serial memory round trip in the chain query_start_loc -> seq_len ->
    # block table -> K / V that bounds the small-batch latency; sm_90 SASS checked).
    if (next_row == row) | (seq_len < 0):
        return
    row = row.to(tl.int64)
    kv_lo = 0
    if USE_WINDOW:
        if CHUNKED:  # the new token's own chunk
            kv_lo = (seq_len - 1) // window * window
        else:
            kv_lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :], other=0.0,
    )
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    ks_base = k_scale_ptr + kv_head
    vs_base = v_scale_ptr + kv_head
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    full_hi = lo + (hi - lo) // BLOCK_N * BLOCK_N
    for start_n in range(lo, full_hi, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, seq_len, start_n, hi, window, k_base, v_base, table_ptr,
            ks_base, vs_base, offs_d, d_mask, stride_cb, stride_ct, num_kv_heads, sm_scale,
            softcap,
            BLOCK_SIZE, BLOCK_N, False, False, USE_SOFTCAP, False, DOT_PRECISION, KV_FP8, False,
        )
    if full_hi < hi:
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, seq_len, full_hi, hi, window, k_base, v_base, table_ptr,
            ks_base, vs_base, offs_d, d_mask, stride_cb, stride_ct, num_kv_heads, sm_scale,
            softcap,
            BLOCK_SIZE, BLOCK_N, True, False, USE_SOFTCAP, False, DOT_PRECISION, KV_FP8, False,
        )
    if USE_SINKS and NUM_SPLITS == 1:
        sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32)
        acc, l_i = fold_sink(acc, m_i, l_i, sink)
    store_split_output(acc, m_i, l_i, out_ptr, lse_ptr, row, seq, split, heads, h_mask, offs_d,
                       d_mask, stride_ot, stride_oh, num_q_heads, HEAD_DIM, NUM_SPLITS)


@triton.jit
def store_split_output(acc, m_i, l_i, out_ptr, lse_ptr, row, seq, split, heads, h_mask, offs_d,
                       d_mask, stride_ot, stride_oh, num_heads, WIDTH: tl.constexpr,
                       NUM_SPLITS: tl.constexpr):
    """A decode program's rows (heads x WIDTH) normalised: straight into out [T, H, WIDTH] with
    one split, else into the fp32 partials [B, H, NUM_SPLITS, WIDTH] with their log2-sum-exp
    (-inf for an empty split) for `_decode_reduce_kernel`."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        ptrs = out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(out_ptr + part[:, None] * WIDTH + offs_d[None, :], out, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    partial_ptr,  # fp32 [B, Hq, NUM_SPLITS, D] per-split normalised outputs
    lse_ptr,  # fp32 [B, Hq, NUM_SPLITS] per-split log2-sum-exp (-inf: empty split)
    out_ptr,  # [T, Hq, D]
    query_start_loc_ptr,  # int32 [B + 1]
    sinks_ptr,  # USE_SINKS: [Hq] attention-sink logits
    stride_ot, stride_oh,
    num_q_heads, head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL (kernels/pdl.py)
    USE_SINKS: tl.constexpr = False,  # the sink joins the merge as one more (empty) split
):
    # Grid (B, Hq): weight each split by 2^(lse - max lse); a sequence with no keys gets zeros.
    # No early return and no load waits for another (the partials are not masked by their
    # weights; empty splits stored zeros): one memory round trip, not three (query_start_loc,
    # then lse, then the partials). A sequence without a new token (its partials unwritten)
    # computes garbage and stores nothing.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq.to(tl.int64) * num_q_heads + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    row = tl.load(query_start_loc_ptr + seq)
    has_token = tl.load(query_start_loc_ptr + seq + 1) > row
    pdl_wait(USE_PDL)
    lse = tl.load(lse_ptr + base + offs_s)
    part = tl.load(partial_ptr + (base + offs_s)[:, None] * head_dim + offs_d[None, :],
                   mask=d_mask[None, :], other=0.0)
    m = tl.max(lse, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part = tl.where((w > 0)[:, None], part, 0.0)
    total = tl.sum(w, 0)
    if USE_SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask & has_token)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Split count of a decode launch; a power of two to bound recompilation. Any value is
    correct (CUDA-graph safe): `max_seq_len` need only bound the sequences' lengths.

    Long contexts: enough (B, Hk, split) programs to fill ~2 waves of a 132-SM GPU, each with
    >= 256 keys. Up to SHORT_SPLIT_KEYS keys (the short-context CUDA graphs, cuda_graphs.py) a
    program walks its keys serially, one 64-key tile per memory round trip, so (H200 CUDA-graph
    replays, Llama-3-8B heads, 384 keys, split + reduce; bench/attention_tiles.py): with B * Hk
    >= ONE_SPLIT_PROGRAMS the launch is bandwidth-bound and one split (no reduce kernel) costs
    the same or less (B=16: 10.4 us, 4 splits 10.6); below that it is latency-bound and wants
    one tile per split (B=1: 8 splits 5.4 us, 16 5.6, 32 5.9, 4 6.5, 1 split 9.2)."""
    programs = max(num_seqs * num_kv_heads, 1)
    short = max_seq_len <= SHORT_SPLIT_KEYS
    if short and programs >= ONE_SPLIT_PROGRAMS:
        return 1
    want = triton.next_power_of_2(triton.cdiv(2 * 132, programs))
    by_keys = triton.next_power_of_2(triton.cdiv(max(max_seq_len, 1), 64 if short else 256))
    return max(1, min(want, 64, by_keys))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    kv_scales: KVScales | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    pdl: str = "auto",
) -> torch.Tensor:
    """Split-KV decode for batches where every sequence has at most one new token.

    Defaults (bf16, no register spills on sm_90): BLOCK_N 64 keys per step; 4 warps for
    head_dim <= 64, 2 for 128 (on an H200, CUDA-graph replays, Llama-3-8B heads: 2 warps beat 8
    by 20-35% from batch 1 to 256, e.g. 69.6 vs 88.3 us at 256 x 256 keys; see
    bench/attention_tiles.py). The split reduction is a second launch: fusing it into the last
    split to finish (an atomic counter per sequence and KV head) measured slower in graph
    replays (12.3 vs 6.4 us at batch 1, 32 splits), its serial merge costing more than a launch."""
    check_attention_args(q, k_cache, v_cache, meta, kv_scales, sinks)
    window, chunked = window_arg(sliding_window, attention_chunk)
    if meta.max_query_len > 1:
        raise ValueError("decode_attention_triton needs q_len <= 1 for every sequence")
    num_seqs = meta.seq_lens.shape[0]
    num_q_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = new_output(q, meta)
    if num_seqs == 0:
        return out
    num_splits = num_splits or default_num_splits(num_seqs, num_kv_heads, meta.max_seq_len)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits {num_splits} must be a power of two")
    group = num_q_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    fp32 = q.dtype == torch.float32  # exact fp32 dots run on FMA units: smaller tiles
    block_n = block_n or (16 if fp32 else 64)
    # fp8 caches keep 2 warps at head_dim 128: on an H200 (bench/fp8_kv_cache.py) 2 warps took
    # 146 / 281 us at batch 64 / 256 against 214 / 420 with 4, and the same at batch 1 (2 warps
    # then spilled 16 bytes; since the full tiles load their scales unmasked, none)
    num_warps = num_warps or (8 if fp32 else 4 if block_d <= 64 else 2)
    if num_splits == 1:
        partial = lse = out
    else:
        partial = torch.empty(num_seqs, num_q_heads, num_splits, head_dim,
                              dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32,
                          device=q.device)
    k_scale, v_scale = kv_scales if kv_scales is not None else (k_cache, v_cache)
    sinks_arg = q if sinks is None else sinks
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, partial, lse, sinks_arg, meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale, logit_softcap or 1.0, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
        num_q_heads, num_kv_heads, HEAD_DIM=head_dim,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        USE_SOFTCAP=logit_softcap is not None,
        USE_WINDOW=window is not None,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        KV_FP8=kv_scales is not None, USE_SINKS=sinks is not None, CHUNKED=chunked,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q, pdl),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            partial, lse, out, meta.query_start_loc, sinks_arg, out.stride(0), out.stride(1),
            num_q_heads, head_dim, NUM_SPLITS=num_splits, BLOCK_D=block_d, num_warps=4,
            USE_SINKS=sinks is not None, **pdl_args(q, pdl),
        )
    return out
