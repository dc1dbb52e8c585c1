"""Prefill / extend attention over the paged KV cache (new tokens attend to prefix and themselves).

New token j of sequence i sits at position seq_lens[i] - q_len_i + j and attends causally to cache
positions 0..that position (its own K/V is already in the cache). With sliding_window W it only
sees the last W positions (k_pos > q_pos - W); with logit_softcap c scores become c*tanh(s/c);
with `attention_chunk` C (llama4's local layers) it sees only the keys of its own chunk of C
positions (k_pos >= q_pos - q_pos % C); with `sinks` [Hq] (gpt-oss) exp(sinks[h]) joins each
row's softmax denominator (a logit whose value row is zero), so the weights of the real keys sum
to less than one.
With `kv_scales` the caches are e4m3 (kernels/kv_quant.py), dequantized inside the tiles; the dots
stay 16-bit (see attend_tile for where the per-token scales go).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.attention_metadata import AttentionMetadata
from flotilla.kernels.attention_tile import attend_tile, fold_sink
from flotilla.kernels.kv_quant import KVScales, check_kv_scales, dequantize_kv_ref
from flotilla.kernels.selection import Tile
from flotilla.kernels.triton_compat import tl, triton


def gather_kv_ref(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int,
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    """The first seq_len tokens of one sequence's K or V: [seq_len, Hk, D] (fp32 when an e4m3
    cache is dequantized with its `scales`)."""
    num_blocks = -(-seq_len // cache.shape[1])
    blocks = block_row[:num_blocks].long()
    rows = cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    if scales is None:
        return rows
    return dequantize_kv_ref(rows, scales.index_select(0, blocks).flatten(0, 1)[:seq_len])


def attend_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None,
    causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked GQA attention in fp32. q [B, L, Hq, D]; k, v [B, S, Hk, D]; mask [B, L, S] bool
    (True = attend), or None with causal=False (everything visible) or causal=True (L == S, a
    whole prompt: lets SDPA skip the masked half); sinks [Hq]: one more logit per head in the
    softmax, attending to nothing. Returns [B, L, Hq, D] in q's dtype."""
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, L|S, D]
    group = q.shape[2] // k.shape[2]
    if causal and (mask is not None or q.shape[1] != k.shape[1]):
        raise ValueError("causal=True needs mask=None and as many queries as keys")
    if causal and (logit_softcap is not None or sinks is not None):
        length = q.shape[1]
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()[None]
    if logit_softcap is None and sinks is None:
        m = None if mask is None else mask[:, None]
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=m, scale=scale, is_causal=causal, enable_gqa=group > 1
        )
    else:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.matmul(probs, vh)
    return out.transpose(1, 2).to(q.dtype)


def causal_mask_ref(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """[..., L, S] bool: key visible to query (causal, optionally within the sliding window or
    the query's attention chunk)."""
    mask = k_pos[..., None, :] <= q_pos[..., :, None]
    if sliding_window is not None:
        mask &= k_pos[..., None, :] > q_pos[..., :, None] - sliding_window
    if attention_chunk is not None:
        mask &= k_pos[..., None, :] >= (q_pos // attention_chunk * attention_chunk)[..., :, None]
    return mask


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    seqs: list[int] | None = None,
    out: torch.Tensor | None = None,
    kv_scales: KVScales | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Per-sequence loop over `seqs` (default: all), writing rows of `out` (default: zeros)."""
    out = torch.zeros_like(q) if out is None else out
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i in range(meta.num_seqs) if seqs is None else seqs:
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        q_len = end - start
        if q_len == 0:
            continue
        k_scales, v_scales = kv_scales if kv_scales is not None else (None, None)
        k = gather_kv_ref(k_cache, meta.block_tables[i], seq_len, k_scales)
        v = gather_kv_ref(v_cache, meta.block_tables[i], seq_len, v_scales)
        if q_len == seq_len and sliding_window is None and attention_chunk is None:
            attn = attend_ref(q[None, start:end], k[None], v[None], None, scale, logit_softcap,
                              causal=True, sinks=sinks)
        else:
            k_pos = torch.arange(seq_len, device=q.device)
            mask = causal_mask_ref(k_pos[seq_len - q_len :], k_pos, sliding_window,
                                   attention_chunk)[None]
            attn = attend_ref(q[None, start:end], k[None], v[None], mask, scale, logit_softcap,
                              sinks=sinks)
        out[start:end] = attn[0]
    return out


FP8_MAXNREG: int | None = 128  # register cap of 8-warp fp8-cache launches (None: ptxas's choice)


# stride_bt: see kernels/paged_attention.py; num_seqs would otherwise compile a variant for 1
# and for multiples of 16 mid-serving
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D] new tokens' queries (token/head strides free, last dim contiguous)
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hk, D]
    k_scale_ptr, v_scale_ptr,  # KV_FP8: fp32 [num_blocks * BLOCK_SIZE, Hk] (else unused)
    out_ptr,  # [T, Hq, D]
    sinks_ptr,  # USE_SINKS: [Hq] attention-sink logits (else unused)
    block_tables_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B] cached + new tokens
    query_start_loc_ptr,  # int32 [B + 1]
    sm_scale, softcap, window,  # softmax scale; logit cap c; sliding window W
    stride_qt, stride_qh,
    stride_cb, stride_ct, stride_ch,  # cache strides (block, token, head), same for K and V
    stride_bt,  # block-table row stride
    stride_ot, stride_oh,
    num_kv_heads,  # Hk: the scales' stride per slot
    num_seqs,  # B (FLAT: sequences past the real ones have no new tokens)
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # Hq // Hk
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (power of two)
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per loop step (may span several cache blocks)
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), else "tf32" (ignored)
    LONGEST_FIRST: tl.constexpr,  # grid (Hq, query blocks, B), last query block first
    KV_FP8: tl.constexpr,  # e4m3 caches with per-(token, head) scales
    FLAT: tl.constexpr = False,  # grid (Hq, T // BLOCK_M + B): no host int of the step sizes it
    USE_SINKS: tl.constexpr = False,  # a learned sink logit per head joins the softmax
    CHUNKED: tl.constexpr = False,  # USE_WINDOW is chunked attention, `window` the chunk size
):
    # One program: BLOCK_M new tokens of one sequence and one query head; an
    # online softmax over the keys they may see, gathered from the paged cache. Keys before the
    # tile's first query are visible to every row and run unmasked; the rest (the diagonal) and
    # the sliding-window edge are masked.
    # LONGEST_FIRST: the heads vary fastest and the query blocks run last-first, so the blocks
    # with the most keys start first and the short ones fill the tail of the launch.
    # FLAT: query block b of sequence s is program qsl[s] // BLOCK_M + s + b (a sequence of L new
    # tokens spans at most cdiv(L, BLOCK_M) <= the gap to the next one's first program); each
    # program finds its sequence by a binary search over query_start_loc.
    if FLAT:
        head = tl.program_id(0)
        pid = tl.program_id(1)
        lo = pid * 0  # int32 tensors: the loop carries them
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            first = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
            lo = tl.where(first <= pid, mid, lo)
            hi = tl.where(first <= pid, hi, mid)
        seq = lo
        m_block = pid - (tl.load(query_start_loc_ptr + seq) // BLOCK_M + seq)
    elif LONGEST_FIRST:
        head = tl.program_id(0)
        m_block = tl.num_programs(1) - 1 - tl.program_id(1)
        seq = tl.program_id(2)
    else:
        m_block = tl.program_id(0)
        head = tl.program_id(1)
        seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # tokens cached before this step's new ones
    kv_head = head // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = ctx + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )
    table_ptr = block_tables_ptr + tl.cast(seq, tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    ks_base = k_scale_ptr + kv_head
    vs_base = v_scale_ptr + kv_head
    first_pos = ctx + m_block * BLOCK_M
    hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    lo = 0
    if USE_WINDOW:
        if CHUNKED:
            lo = first_pos // window * window
        else:
            lo = tl.maximum(first_pos - window + 1, 0)
    mid = lo + (first_pos + 1 - lo) // BLOCK_N * BLOCK_N  # keys below mid: no causal mask

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, start_n, hi, window, k_base, v_base, table_ptr,
            ks_base, vs_base, offs_d, d_mask, stride_cb, stride_ct, num_kv_heads, sm_scale,
            softcap,
            BLOCK_SIZE, BLOCK_N, False, False, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, KV_FP8,
            BLOCK_M >= 64, CHUNKED,
        )
    for start_n in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, start_n, hi, window, k_base, v_base, table_ptr,
            ks_base, vs_base, offs_d, d_mask, stride_cb, stride_ct, num_kv_heads, sm_scale,
            softcap,
            BLOCK_SIZE, BLOCK_N, True, True, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, KV_FP8,
            BLOCK_M >= 64, CHUNKED,
        )
    if USE_SINKS:
        acc, l_i = fold_sink(acc, m_i, l_i, tl.load(sinks_ptr + head).to(tl.float32))
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
    )


def check_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    kv_scales: KVScales | None = None, sinks: torch.Tensor | None = None,
) -> None:
    """Shape / dtype / layout contract shared by the attention launchers."""
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.device != q.device
                              or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be contiguous [{q.shape[1]}] on {q.device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"want q [T, Hq, D], caches [N, bs, Hk, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two")
    check_kv_scales(k_cache, v_cache, kv_scales)
    if kv_scales is None and not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches must have a contiguous last dim")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides (one offset serves both)")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(f"meta.{name} must be int32 on {q.device}, got {t.dtype} {t.device}")
    if meta.block_tables.stride(-1) != 1:
        raise ValueError("meta.block_tables must have a contiguous last dim")


def window_arg(sliding_window: int | None, attention_chunk: int | None
               ) -> tuple[int | None, bool]:
    """The kernels' (window, CHUNKED): one key-range limit, a sliding window or a chunk."""
    if sliding_window is not None and attention_chunk is not None:
        raise ValueError("a layer has a sliding window or attention chunks, not both")
    if attention_chunk is not None:
        if attention_chunk < 1:
            raise ValueError(f"attention_chunk must be >= 1, got {attention_chunk}")
        return attention_chunk, True
    return sliding_window, False


def new_output(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Output buffer; rows past the last sequence (padding) are zeroed, the rest get written
    (under `bounds_only` the host does not know where the padding starts: all zeroed)."""
    if meta.bounds_only:
        return torch.zeros_like(q)
    out = torch.empty_like(q)
    if meta.query_start_loc_cpu[-1] < q.shape[0]:
        out[meta.query_start_loc_cpu[-1] :].zero_()
    return out


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    longest_first: bool = True,
    kv_scales: KVScales | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """Any mix of q_len >= 1 sequences. Grid (Hq, cdiv(max_query_len, BLOCK_M), B).

    Default tiles (bf16), the fastest spill-free ones measured on an H200 (Llama-3-8B heads,
    bench/attention_tiles.py): BLOCK_M 128 with 8 warps, 2 stages, BLOCK_N 64 for head_dim <= 64
    else 32 (a 4096-token prompt: 363 us a layer vs 421 with BLOCK_N 64; dispatching the query
    blocks longest first took it from 436 to 363); BLOCK_M 64 with 4 warps when no sequence has
    more than 128 new tokens (89 vs 111 us for 64 prompts of 128), smaller below. fp32 is
    supported for exactness (IEEE dots, no TF32) with small tiles, not tuned.
    An fp8 cache (`kv_scales`) keeps the tiles; with 8 warps it is capped at 128 registers
    (uncapped, ptxas takes ~170 at head_dim 128: one program per SM; capped, two as with bf16,
    and no spills).
    `tile` (block_m, block_n, num_warps, num_stages; the selection's prefill_tile,
    FLOTILLA_PREFILL_TILE="m,n,warps,stages", kernels/selection.py) overrides the defaults and
    the tile arguments for 16-bit inputs (benchmark sweeps).

    With `meta.bounds_only` (a CUDA-graph capture of a whole step, services/engine/step_graphs.py)
    the launch reads no host value of the step: max_query_len is taken to be the row count T, and
    the grid is (Hq, T // BLOCK_M + B) with each program finding its sequence on the device."""
    check_attention_args(q, k_cache, v_cache, meta, kv_scales, sinks)
    window, chunked = window_arg(sliding_window, attention_chunk)
    num_seqs = meta.seq_lens.shape[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = new_output(q, meta)
    if num_seqs == 0 or meta.max_query_len == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    fp32 = q.dtype == torch.float32  # exact fp32 dots run on FMA units: smaller tiles
    if tile and not fp32:
        block_m, block_n, num_warps, num_stages = tile
    # bounds_only: max_query_len is only the row count, and a graph step is short (mostly
    # decode rows and short prompts): the small tile
    block_m = block_m or (64 if fp32 or meta.bounds_only or meta.max_query_len <= 128 else 128)
    block_m = max(16, min(block_m, triton.next_power_of_2(meta.max_query_len)))
    block_n = block_n or (16 if fp32 else 64 if block_d <= 64 else 32)
    num_warps = num_warps or (8 if block_m >= 128 or fp32 else 4)
    fp8_cap = kv_scales is not None and not fp32 and num_warps == 8
    m_blocks = triton.cdiv(meta.max_query_len, block_m)
    if meta.bounds_only:
        grid: tuple[int, ...] = (q.shape[1], q.shape[0] // block_m + num_seqs)
    elif longest_first:
        grid = (q.shape[1], m_blocks, num_seqs)
    else:
        grid = (m_blocks, q.shape[1], num_seqs)
    k_scale, v_scale = kv_scales if kv_scales is not None else (k_cache, v_cache)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out, q if sinks is None else sinks,
        meta.block_tables, meta.seq_lens,
        meta.query_start_loc,
        scale, logit_softcap or 1.0, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1), num_kv_heads, num_seqs,
        HEAD_DIM=head_dim,
        GROUP=q.shape[1] // num_kv_heads,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        USE_SOFTCAP=logit_softcap is not None,
        USE_WINDOW=window is not None,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        LONGEST_FIRST=longest_first,
        KV_FP8=kv_scales is not None,
        FLAT=meta.bounds_only,
        USE_SINKS=sinks is not None, CHUNKED=chunked,
        num_warps=num_warps,
        num_stages=num_stages,
        maxnreg=FP8_MAXNREG if fp8_cap else None,
    )
    return out
