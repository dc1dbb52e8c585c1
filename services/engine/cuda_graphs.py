"""CUDA graphs of decode steps at bucketed batch sizes, replayed with padded inputs.

Rules:
- One graph per bucket (1, 2, 4, 8, ..., max_batch), captured largest first into one shared memory
  pool. A graph runs the model and the LM head on every row of its bucket.
- The graphs read persistent input tensors owned here; `replay` copies a step's inputs in and pads
  the unused rows with slot -1 (their K/V are never written) and seq_len 1. Padded rows' logits
  are garbage and never read. Hybrid models' steps carry state_indices: padded rows get state
  slot -1 (the linear-attention kernels skip them); the graphs read the persistent tensor.
- The host ints baked into a capture (max_query_len 1, max_seq_len = max_model_len) cover every
  decode step the engine can produce.
- Short-context graphs: buckets up to SHORT_GRAPH_MAX_BATCH get a second graph captured with
  max_seq_len = short_context, the bound the attention kernels size their KV splits by
  (kernels/paged_attention.py `default_num_splits`: at batch 1 and 8 KV heads 8 splits instead of
  32, at 16 rows one split and no reduce kernel). `replay` takes it while the step's longest
  sequence (a host int) fits; its padded rows (seq_len 1) always do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flotilla.services.engine.forward_context import AttentionMetadata, forward_context

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Buckets that also get a short-context graph: beyond 16 rows the long graphs' split counts are
# already 1-2 (kernels/paged_attention.py) and a second graph would gain little.
SHORT_GRAPH_MAX_BATCH = 16


def graph_buckets(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: BUCKETS below max_batch, then max_batch."""
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, positions) -> logits


def capture_graph(pool: Any, fn: Callable[..., torch.Tensor], *args: Any
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Call fn(*args) twice outside the capture (Triton compiles and autotunes there), then
    capture one call into the memory pool `pool` (None: a new one); returns the graph and its
    output."""
    for _ in range(2):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args)
    return graph, out


class DecodeGraphs:
    def __init__(
        self, forward: ForwardFn, max_batch: int, max_blocks_per_seq: int, max_model_len: int,
        device: torch.device, short_context: int = 0,
    ) -> None:
        """short_context: the longest sequence a short-context graph serves (0: none)."""
        self.forward = forward
        self.buckets = graph_buckets(max_batch)
        self.max_model_len = max_model_len
        # A bound at or above max_model_len would capture the long graphs again.
        self.short_context = short_context if 0 < short_context < max_model_len else 0
        g = self.buckets[-1]
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(g, dtype=i64, device=device)
        self.positions = torch.zeros(g, dtype=i64, device=device)
        self.slot_mapping = torch.full((g,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(g, dtype=i32, device=device)
        self.query_start_loc = torch.arange(g + 1, dtype=i32, device=device)
        self.block_tables = torch.zeros(g, max_blocks_per_seq, dtype=i32, device=device)
        self.state_indices = torch.full((g,), -1, dtype=i32, device=device)
        # (bucket, short) -> (graph, its logits)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def short_buckets(self) -> list[int]:
        """The buckets captured a second time for short contexts."""
        if not self.short_context:
            return []
        return [b for b in self.buckets if b <= SHORT_GRAPH_MAX_BATCH]

    def _meta(self, bs: int, short: bool) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            max_query_len=1,
            max_seq_len=self.short_context if short else self.max_model_len,
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[1] * bs,
            state_indices=self.state_indices[:bs],
            has_initial_state=None,
        )

    def capture(self) -> Any:
        """Capture every graph; returns their memory pool (step_graphs.py shares it)."""
        pool = None
        short_buckets = set(self.short_buckets)
        for bs in reversed(self.buckets):
            for short in (False, True) if bs in short_buckets else (False,):
                with forward_context(self._meta(bs, short)):
                    graph, logits = capture_graph(pool, self.forward, self.input_ids[:bs],
                                                  self.positions[:bs])
                pool = graph.pool()
                self.graphs[bs, short] = (graph, logits)
        torch.cuda.synchronize()
        return pool

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def graph_for(self, batch: int, max_seq_len: int) -> tuple[int, bool]:
        """(bucket, short) of the graph that runs a decode step of `batch` rows whose longest
        sequence has max_seq_len tokens (after this step's token)."""
        bs = self.bucket_for(batch)
        assert bs is not None, f"decode batch {batch} exceeds the captured graphs"
        short = max_seq_len <= self.short_context and bs <= SHORT_GRAPH_MAX_BATCH
        return bs, short

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Run a decode-only step of n <= max_batch rows; returns logits [n, vocab]."""
        n = input_ids.shape[0]
        bs, short = self.graph_for(n, meta.max_seq_len)
        graph, logits = self.graphs[bs, short]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        cols = meta.block_tables.shape[1]
        self.block_tables[:n, :cols].copy_(meta.block_tables, non_blocking=True)
        if meta.state_indices is not None:
            self.state_indices[:n].copy_(meta.state_indices, non_blocking=True)
            self.state_indices[n:bs].fill_(-1)
        graph.replay()
        return logits[:n]
