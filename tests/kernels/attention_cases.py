"""Random paged-KV batches for the attention kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flotilla.services.engine.forward_context import AttentionMetadata
from tests.kernels.conftest import DEVICE


@dataclass
class AttentionCase:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    pad_rows: int = 0,
) -> AttentionCase:
    """Sequences whose blocks are scattered randomly over a cache with spare blocks; the block
    table is padded with zeros past each sequence's last block. `pad_rows` extra query rows at
    the end belong to no sequence (CUDA-graph padding)."""
    assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks).tolist()
    width = max(max(blocks_per_seq), 1) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=torch.full((qsl[-1] + pad_rows,), -1, dtype=torch.int64, device=DEVICE),
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )
    return AttentionCase(
        q=torch.randn(qsl[-1] + pad_rows, num_q_heads, head_dim, dtype=dtype, device=DEVICE),
        k_cache=torch.randn(shape, dtype=dtype, device=DEVICE),
        v_cache=torch.randn(shape, dtype=dtype, device=DEVICE),
        meta=meta,
    )


def bounds_only(meta: AttentionMetadata, extra_seqs: int) -> AttentionMetadata:
    """`meta` as a whole-step CUDA graph sees it (services/engine/step_graphs.py): `extra_seqs`
    empty sequences after the real ones, no host lists, and max_query_len only the row count."""
    total = int(meta.query_start_loc[-1])

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        tail = torch.full((extra_seqs, *t.shape[1:]), value, dtype=t.dtype, device=t.device)
        return torch.cat([t, tail])

    return AttentionMetadata(
        query_start_loc=pad(meta.query_start_loc, total), seq_lens=pad(meta.seq_lens, 0),
        block_tables=pad(meta.block_tables, 7), slot_mapping=meta.slot_mapping,
        max_query_len=meta.slot_mapping.shape[0], max_seq_len=meta.max_seq_len,
        query_start_loc_cpu=[], seq_lens_cpu=[], bounds_only=True,
    )
