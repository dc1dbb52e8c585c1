"""Paged attention entry point and the split-KV (flash-decoding) decode kernel.

Decode-only batches (every sequence has one new token) run the split-KV decode kernel; any batch
with a q_len > 1 runs the prefill/extend kernel, which handles q_len == 1 rows as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.prefill_attention import attend_ref, prefill_attention_ref
from services.engine.forward_context import AttentionMetadata

# Decode reference: cap on gathered elements per batched chunk (bounds CPU memory).
_REF_CHUNK_ELEMS = 1 << 25


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    seqs: list[int],
    out: torch.Tensor,
) -> torch.Tensor:
    """Batched reference for sequences with exactly one new token: pads their KV to a common
    length and runs one masked attention per chunk of sequences."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    seq_lens_cpu, qsl = meta.seq_lens_cpu, meta.query_start_loc_cpu
    per_seq = max((seq_lens_cpu[i] for i in seqs), default=1) * num_kv_heads * head_dim
    chunk = max(1, _REF_CHUNK_ELEMS // per_seq)
    for c in range(0, len(seqs), chunk):
        ids = seqs[c : c + chunk]
        lens = torch.tensor([seq_lens_cpu[i] for i in ids], device=q.device)
        rows = torch.tensor([qsl[i] for i in ids], device=q.device)
        max_len = max(seq_lens_cpu[i] for i in ids)
        num_blocks = -(-max_len // block_size)
        tables = meta.block_tables[torch.tensor(ids, device=q.device), :num_blocks].long()
        k = k_cache[tables].flatten(1, 2)  # [n, num_blocks * block_size, Hk, D]
        v = v_cache[tables].flatten(1, 2)
        k_pos = torch.arange(k.shape[1], device=q.device)
        mask = k_pos[None, :] < lens[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > (lens[:, None] - 1 - sliding_window)
        attn = attend_ref(q[rows][:, None], k, v, mask[:, None], scale, logit_softcap)
        out[rows] = attn[:, 0]
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Torch reference: decode rows batched, prefill/extend rows one sequence at a time."""
    out = torch.zeros_like(q)
    qsl = meta.query_start_loc_cpu
    q_lens = [qsl[i + 1] - qsl[i] for i in range(meta.num_seqs)]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    extend = [i for i, n in enumerate(q_lens) if n > 1]
    if decode:
        decode_attention_ref(
            q, k_cache, v_cache, meta, scale, sliding_window, logit_softcap, decode, out
        )
    if extend:
        prefill_attention_ref(
            q, k_cache, v_cache, meta, scale, sliding_window, logit_softcap, extend, out
        )
    return out


def paged_attention_triton(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise NotImplementedError("paged_attention: Triton kernel not written yet")
