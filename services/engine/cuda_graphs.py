"""CUDA graphs of decode steps at bucketed batch sizes, replayed with padded inputs.

Rules:
- One graph per bucket (1, 2, 4, 8, ..., max_batch), captured largest first into one shared memory
  pool. A graph runs the model and the LM head on every row of its bucket.
- The graphs read persistent input tensors owned here; `replay` copies a step's inputs in and pads
  the unused rows with slot -1 (their K/V are never written) and seq_len 1. Padded rows' logits
  are garbage and never read.
- The host ints baked into a capture (max_query_len 1, max_seq_len = max_model_len) cover every
  decode step the engine can produce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.forward_context import AttentionMetadata, forward_context

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, positions) -> logits


class DecodeGraphs:
    def __init__(
        self, forward: ForwardFn, max_batch: int, max_blocks_per_seq: int, max_model_len: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_model_len = max_model_len
        g = self.buckets[-1]
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(g, dtype=i64, device=device)
        self.positions = torch.zeros(g, dtype=i64, device=device)
        self.slot_mapping = torch.full((g,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(g, dtype=i32, device=device)
        self.query_start_loc = torch.arange(g + 1, dtype=i32, device=device)
        self.block_tables = torch.zeros(g, max_blocks_per_seq, dtype=i32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[1] * bs,
        )

    def capture(self) -> None:
        pool = None
        for bs in reversed(self.buckets):
            meta = self._meta(bs)
            with forward_context(meta):
                for _ in range(2):  # compile / autotune outside the capture
                    self.forward(self.input_ids[:bs], self.positions[:bs])
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.forward(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize()

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Run a decode-only step of n <= max_batch rows; returns logits [n, vocab]."""
        n = input_ids.shape[0]
        bs = self.bucket_for(n)
        assert bs is not None, f"decode batch {n} exceeds the captured graphs"
        graph, logits = self.graphs[bs]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        cols = meta.block_tables.shape[1]
        self.block_tables[:n, :cols].copy_(meta.block_tables, non_blocking=True)
        graph.replay()
        return logits[:n]
