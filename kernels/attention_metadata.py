"""What one forward pass tells the attention kernels about its batch over the paged KV cache.

The engine's ModelRunner builds it once per step (services/engine/forward_context.py installs it
for the attention layers); the kernels in this package read it. It lives here, below the engine,
so kernels/ never imports from services/.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class AttentionMetadata:
    """Flattened description of one forward pass over paged KV.

    query_start_loc: int32 [B+1], cumulative count of new tokens per sequence.
    seq_lens: int32 [B], tokens of each sequence in the cache after this step (cached + new).
    block_tables: int32 [B, max_blocks_per_seq], block ids of each sequence, padded with 0.
    slot_mapping: int64 [T], flat cache slot (block_id * block_size + offset) of each new token;
        -1 marks padding rows whose K/V must not be written (CUDA-graph padding).
    max_query_len / max_seq_len: host ints, the largest entries of the two tensors above.
    query_start_loc_cpu / seq_lens_cpu: host copies for the CPU reference path.
    bounds_only: the metadata of a CUDA-graph capture of a whole step (step_graphs.py): the
        tensors change between replays, so the kernels must not size or branch on the step's host
        values; max_query_len / max_seq_len are only bounds, the host lists are empty, and
        sequences past the real ones have no new tokens and seq_len 0.
    state_indices: int32 [B], each sequence's slot in the linear-attention state pool (hybrid
        models, services/engine/state_pool.py); -1 marks padding rows, whose state no kernel may
        touch (CUDA-graph padding). None for models without linear attention.
    has_initial_state: bool [B], the sequence continues from its slot's state (it has computed
        tokens before this step); None with state_indices.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    bounds_only: bool = False
    state_indices: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def read_back(self) -> AttentionMetadata:
        """A bounds_only metadata with its host lists read from the tensors (the torch reference
        path runs a graph step's metadata this way; a sync on CUDA)."""
        return replace(self, query_start_loc_cpu=self.query_start_loc.tolist(),
                       seq_lens_cpu=self.seq_lens.tolist(), bounds_only=False)
