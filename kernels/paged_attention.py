"""Paged attention entry point and the torch references; the split-KV (flash-decoding) decode
kernel is kernels/decode_attention.py (its names are re-exported here).

Decode-only batches (every sequence has one new token) run the split-KV decode kernel; any batch
with a q_len > 1 runs the prefill/extend kernel, which handles q_len == 1 rows as well.
With `kv_scales` the caches are e4m3 (kernels/kv_quant.py), dequantized inside the tiles. With
`sinks` [Hq] (gpt-oss's learned attention sinks) each head's sink logit joins the softmax
denominator: folded into the output of a one-split decode, into the split merge otherwise.
"""

from __future__ import annotations

import torch

from flotilla.kernels.attention_metadata import AttentionMetadata
from flotilla.kernels.decode_attention import (  # noqa: F401 (re-exported from their old home)
    ONE_SPLIT_PROGRAMS,
    SHORT_SPLIT_KEYS,
    _decode_reduce_kernel,
    decode_attention_triton,
    default_num_splits,
    store_split_output,
)
from flotilla.kernels.kv_quant import KVScales, dequantize_kv_ref
from flotilla.kernels.prefill_attention import (
    attend_ref,
    prefill_attention_ref,
    prefill_attention_triton,
)
from flotilla.kernels.selection import Tile

# Decode reference: cap on gathered elements per batched chunk (bounds CPU memory).
_REF_CHUNK_ELEMS = 1 << 25


def _rows(values: list[int], device: torch.device) -> slice | torch.Tensor:
    """A run of consecutive ints as a slice (views, no gather), else an index tensor."""
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return torch.tensor(values, device=device)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    seqs: list[int],
    out: torch.Tensor | None,
    kv_scales: KVScales | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Batched reference for sequences with exactly one new token: pads their KV to a common
    length and runs one masked attention per chunk of sequences. `out` None: the query rows are
    exactly 0..len(seqs)-1 and the result is returned as a new tensor (the batch-1 CPU decode
    path: no zero-filled output, no gathers of q or the block table, no mask when every
    sequence of a chunk has the same length)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    seq_lens_cpu, qsl = meta.seq_lens_cpu, meta.query_start_loc_cpu
    per_seq = max((seq_lens_cpu[i] for i in seqs), default=1) * num_kv_heads * head_dim
    chunk = max(1, _REF_CHUNK_ELEMS // per_seq)
    result = out if out is not None else torch.empty_like(q)
    for c in range(0, len(seqs), chunk):
        ids = seqs[c : c + chunk]
        ids_lens = [seq_lens_cpu[i] for i in ids]
        max_len = max(ids_lens)
        num_blocks = -(-max_len // block_size)
        tables = meta.block_tables[_rows(ids, q.device)][:, :num_blocks].reshape(-1)
        gathered = (len(ids), num_blocks * block_size, num_kv_heads, head_dim)
        k = k_cache.index_select(0, tables).view(gathered)
        v = v_cache.index_select(0, tables).view(gathered)
        if kv_scales is not None:
            k = dequantize_kv_ref(k, kv_scales.k.index_select(0, tables).view(gathered[:3]))
            v = dequantize_kv_ref(v, kv_scales.v.index_select(0, tables).view(gathered[:3]))
        mask = None
        if sliding_window is None and attention_chunk is None and min(ids_lens) == max_len:
            k, v = k[:, :max_len], v[:, :max_len]  # every key of the chunk is visible
        else:
            lens = torch.tensor(ids_lens, device=q.device)
            k_pos = torch.arange(k.shape[1], device=q.device)
            mask = k_pos[None, :] < lens[:, None]
            if sliding_window is not None:
                mask &= k_pos[None, :] > (lens[:, None] - 1 - sliding_window)
            if attention_chunk is not None:  # the new token's own chunk
                mask &= k_pos[None, :] >= ((lens[:, None] - 1) // attention_chunk
                                           * attention_chunk)
            mask = mask[:, None]
        rows = _rows([qsl[i] for i in ids], q.device)
        attn = attend_ref(q[rows][:, None], k, v, mask, scale, logit_softcap,
                          sinks=sinks)[:, 0]
        if isinstance(rows, slice):
            result[rows] = attn
        else:
            result.index_copy_(0, rows, attn)
    return result


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    kv_scales: KVScales | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Torch reference: decode rows batched, prefill/extend rows one sequence at a time."""
    if meta.bounds_only:
        meta = meta.read_back()
    qsl = meta.query_start_loc_cpu
    q_lens = [qsl[i + 1] - qsl[i] for i in range(meta.num_seqs)]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    extend = [i for i, n in enumerate(q_lens) if n > 1]
    if decode and not extend and len(decode) == meta.num_seqs == q.shape[0]:
        # Decode only, no padding rows: every output row is written.
        return decode_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window,
                                    logit_softcap, decode, None, kv_scales, sinks,
                                    attention_chunk)
    out = torch.zeros_like(q)
    if decode:
        decode_attention_ref(
            q, k_cache, v_cache, meta, scale, sliding_window, logit_softcap, decode, out,
            kv_scales, sinks, attention_chunk,
        )
    if extend:
        prefill_attention_ref(
            q, k_cache, v_cache, meta, scale, sliding_window, logit_softcap, extend, out,
            kv_scales, sinks, attention_chunk,
        )
    return out


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    kv_scales: KVScales | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    pdl: str = "auto",
    tile: Tile | None = None,
) -> torch.Tensor:
    """Decode-only batches -> split-KV decode kernel (launched under the selection's `pdl`);
    anything else -> prefill/extend kernel (the selection's prefill `tile`, if any)."""
    if meta.is_decode_only:
        return decode_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window,
                                       logit_softcap, kv_scales=kv_scales, sinks=sinks,
                                       attention_chunk=attention_chunk, pdl=pdl)
    return prefill_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window,
                                    logit_softcap, kv_scales=kv_scales, sinks=sinks,
                                    attention_chunk=attention_chunk, tile=tile)
