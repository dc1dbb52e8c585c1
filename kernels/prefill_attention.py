"""Prefill / extend attention over the paged KV cache (new tokens attend to prefix and themselves).

New token j of sequence i sits at position seq_lens[i] - q_len_i + j and attends causally to cache
positions 0..that position (its own K/V is already in the cache). With sliding_window W it only
sees the last W positions (k_pos > q_pos - W); with logit_softcap c scores become c*tanh(s/c).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.engine.forward_context import AttentionMetadata


def gather_kv_ref(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence's K or V: [seq_len, Hk, D]."""
    num_blocks = -(-seq_len // cache.shape[1])
    return cache[block_row[:num_blocks].long()].flatten(0, 1)[:seq_len]


def attend_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None,
) -> torch.Tensor:
    """Masked GQA attention in fp32. q [B, L, Hq, D]; k, v [B, S, Hk, D]; mask [B, L, S] bool
    (True = attend) or None (everything visible). Returns [B, L, Hq, D] in q's dtype."""
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, L|S, D]
    group = q.shape[2] // k.shape[2]
    if logit_softcap is None:
        m = None if mask is None else mask[:, None]
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=m, scale=scale, enable_gqa=group > 1
        )
    else:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), vh)
    return out.transpose(1, 2).to(q.dtype)


def causal_mask_ref(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """[..., L, S] bool: key visible to query (causal, optionally within the sliding window)."""
    mask = k_pos[..., None, :] <= q_pos[..., :, None]
    if sliding_window is not None:
        mask &= k_pos[..., None, :] > q_pos[..., :, None] - sliding_window
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
) -> torch.Tensor:
    """Per-sequence loop over `seqs` (default: all), writing rows of `out` (default: zeros)."""
    out = torch.zeros_like(q) if out is None else out
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i in range(meta.num_seqs) if seqs is None else seqs:
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv_ref(k_cache, meta.block_tables[i], seq_len)
        v = gather_kv_ref(v_cache, meta.block_tables[i], seq_len)
        k_pos = torch.arange(seq_len, device=q.device)
        q_pos = k_pos[seq_len - q_len :]
        mask = causal_mask_ref(q_pos, k_pos, sliding_window)
        attn = attend_ref(q[None, start:end], k[None], v[None], mask[None], scale, logit_softcap)
        out[start:end] = attn[0]
    return out
