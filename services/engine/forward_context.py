"""Per-step batch metadata handed from the ModelRunner to every attention layer.

Rules:
- The ModelRunner builds one `AttentionMetadata` (kernels/attention_metadata.py) per forward
  pass (no per-token Python loops) and installs it with `forward_context(meta)`; attention
  layers read it with `get_forward_context()`.
- The batch is flattened: the new tokens of all sequences are concatenated, sequence i owning rows
  `query_start_loc[i]:query_start_loc[i+1]`. Prefill chunks and decode tokens mix freely.
- The KV cache of a layer is a K and a V tensor `[num_blocks, block_size, *per_token_shape]`
  (`Attention.kv_cache_shape()`: `(num_kv_heads, head_dim)` each for standard attention; MLA
  keeps one latent row and no V) owned by the ModelRunner and bound to the layer at start-up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from flotilla.kernels.attention_metadata import AttentionMetadata

_CONTEXT: AttentionMetadata | None = None


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside forward_context(): the ModelRunner sets it")
    return _CONTEXT


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, meta
    try:
        yield meta
    finally:
        _CONTEXT = previous
