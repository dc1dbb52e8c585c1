"""One KV tile of paged attention (shared by the prefill / extend and the split-KV decode
kernels): gather K / V rows of a block of keys through the block table, score them (soft-cap,
causal / sliding-window masks), fold them into the running online softmax. fp8 caches: the
per-token scales either widen K / V rows to bf16 as they load (FP8_ROWS, large query tiles) or
scale the scores and the softmax weights (small tiles, decode). `fold_sink` adds a learned
attention sink (gpt-oss) to a finished online softmax.
"""

from __future__ import annotations

from flotilla.kernels.triton_compat import tl, triton

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def score_transform(s, sm_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Raw q.k -> scaled (optionally soft-capped) logits in the log2 domain (for exp2)."""
    if USE_SOFTCAP:
        return softcap * _tanh(s * (sm_scale / softcap)) * LOG2E
    else:
        return s * (sm_scale * LOG2E)


@triton.jit
def load_scales(ptrs, valid, MASK_N: tl.constexpr):
    """fp8 KV scales of a tile's keys; out-of-range keys (MASK_N tiles only) get 0."""
    if MASK_N:
        return tl.load(ptrs, mask=valid, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def attend_tile(
    acc, m_i, l_i,  # running output [M, BLOCK_D], row max [M], row sum [M] (log2 domain)
    q, q_pos,  # queries [M, BLOCK_D]; their positions [M] (read when CAUSAL or USE_WINDOW)
    start_n, hi, window,  # keys start_n .. start_n + BLOCK_N, valid below hi
    k_cache_ptr, v_cache_ptr,  # this KV head's base: cache_ptr + kv_head * stride_h
    table_ptr,  # this sequence's block-table row
    k_scale_ptr, v_scale_ptr,  # KV_FP8: this KV head's scales (scale_ptr + kv_head)
    offs_d, d_mask,
    stride_b, stride_t,  # cache block / token strides (K and V caches share them)
    stride_s,  # scale stride per slot (Hk)
    sm_scale, softcap,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_N: tl.constexpr,  # the tile may reach past hi
    CAUSAL: tl.constexpr,  # the tile may hold keys after some query (diagonal tile)
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # e4m3 caches with per-(token, KV head) scales
    FP8_ROWS: tl.constexpr,  # KV_FP8: fold the scales into the K / V rows, else into qk / p
    CHUNKED: tl.constexpr = False,  # USE_WINDOW means chunked attention: `window` is the chunk
):
    """One online-softmax step over BLOCK_N keys gathered from the paged cache: each key's
    block comes from the block table, so a tile may span several cache blocks.

    KV_FP8: e4m3 tiles are widened to q's dtype; the dots stay 16-bit. FP8_ROWS (wgmma tiles,
    BLOCK_M >= 64, whose widened K / V pass through registers on their way back to shared
    memory anyway): each row is scaled as it is widened (e4m3 -> fp32, x scale, one rounding to
    bf16), its scale loaded once per row of the load layout, and the rest of the step is the bf16
    cache's. Scaling the score columns instead needs the scales gathered in the dot's column layout
    and e4m3 -> bf16 goes e4m3 -> f16 -> bf16, one F2F conversion (16/clk/SM) per element: sm_90
    SASS of the default 128 x 32 tile, head_dim 128, had 542 instructions in the loop (bf16: 298)
    and 194 registers; folded, 383 and 128 (launched capped, FP8_MAXNREG) without spills.
    Otherwise (decode's 16-row mma tiles, small prefill tiles, where the operands are widened in
    the mma layout) the raw scores are scaled per key (qk * k_scale) and p per value token
    before its cast (p * v_scale)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hi
    if MASK_N:
        blk = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        kv_mask = n_valid[:, None] & d_mask[None, :]
    else:
        blk = tl.load(table_ptr + offs_n // BLOCK_SIZE)
        kv_mask = d_mask[None, :]
    rows = blk.to(tl.int64) * stride_b + (offs_n % BLOCK_SIZE) * stride_t
    kv_offs = rows[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D], shared by K and V
    k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    if KV_FP8:
        slots = (blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE) * stride_s
        k_scale = load_scales(k_scale_ptr + slots, n_valid, MASK_N)
        if FP8_ROWS:
            k = k.to(tl.float32) * k_scale[:, None]
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if KV_FP8 and not FP8_ROWS:
        qk = qk * k_scale[None, :]
    s = score_transform(qk, sm_scale, softcap, USE_SOFTCAP)
    if MASK_N:
        s = tl.where(n_valid[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    if USE_WINDOW:
        if CHUNKED:  # keys of the query's own chunk only (llama4's local layers)
            s = tl.where(offs_n[None, :] >= (q_pos // window * window)[:, None], s,
                         float("-inf"))
        else:
            s = tl.where(offs_n[None, :] > q_pos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    pv = p
    if KV_FP8:
        v_scale = load_scales(v_scale_ptr + slots, n_valid, MASK_N)
        if FP8_ROWS:
            v = v.to(tl.float32) * v_scale[:, None]
        else:
            pv = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def fold_sink(acc, m_i, l_i, sink):
    """A learned attention sink (gpt-oss): one more logit `sink` (natural-log domain, per query
    head) in the softmax denominator, attending to a zero value. Folded into a finished online
    softmax (acc [M, D], row max m_i and row sum l_i in the log2 domain) under a common max, so
    neither a large sink nor large scores overflow; rows that saw no key (m_i = -inf) get
    l = 1 and stay zero."""
    s = sink * LOG2E
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(s - m_new)
