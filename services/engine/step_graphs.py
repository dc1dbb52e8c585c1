"""CUDA graphs of whole prefill and mixed steps at the short token buckets.

Why: an eager step launches about ten kernels a layer from Python. Over 32 layers that is 14-16 ms
of host time on an H100 host (bench/shape_probe.py, git history), while the GPU needs 7-13 ms for a
step of up to 512 tokens of a Llama-3-8B. So a short prompt's time to first token, and short mixed
steps, were bound by the host; replayed, a 128-token prompt's TTFT went from 15.2 to 8.1 ms
(bench/ttft_probe.py, git history). Decode-only steps have their own graphs (cuda_graphs.py).

Rules:
- One graph per token bucket (row_buckets.token_bucket) up to `max_tokens`, captured largest
  first into the decode graphs' memory pool. Graph T runs the model on T rows and gathers the
  final hidden states of R(T) = logits_bucket(min(T, max_seqs)) rows. The LM head runs eagerly
  after the replay, at a logits bucket warmed at start-up: a [R, vocab] fp32 output kept per
  graph would hold ~1.4 GB for a 128k vocabulary.
- The graphs read persistent tensors owned here. `replay` copies in a step's padded inputs
  (StepInputs: T rows, S' <= R(T) sampled rows). The sequence tensors are padded to max_seqs
  with empty sequences (query_start_loc repeats the total, seq_len 0), the sampled rows with row
  0. Token padding rows already carry slot -1.
- The attention metadata is `bounds_only` (forward_context.py): no kernel sizes its launch on a
  host value of the step (kernels/prefill_attention.py's FLAT grid), and the fused long-prompt
  path is off. `supported` names what may be captured: `Attention` layers only (MLA reads host
  lists). Under tensor parallelism every rank captures the same buckets, the all-reduces inside
  (as the decode graphs' are, at the same message sizes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flotilla.services.engine.cuda_graphs import capture_graph
from flotilla.services.engine.forward_context import AttentionMetadata, forward_context
from flotilla.services.engine.layers.attention import Attention
from flotilla.services.engine.row_buckets import logits_bucket
from flotilla.services.engine.step_inputs import StepInputs

# (ids, positions, sampled rows) -> final hidden states of the sampled rows
HiddenFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def supported(attention: list[Attention]) -> bool:
    """Whether a model's steps may be captured whole."""
    return all(type(a) is Attention for a in attention)


class StepGraphs:
    def __init__(self, forward: HiddenFn, buckets: list[int], max_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, device: torch.device) -> None:
        """buckets: the token counts that get a graph (each one a token bucket)."""
        self.forward = forward
        self.buckets = sorted(buckets)
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        t = self.buckets[-1] if self.buckets else 0
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(t, dtype=i64, device=device)
        self.positions = torch.zeros(t, dtype=i64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=i64, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=i32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=i32, device=device)
        self.sampled_rows = torch.zeros(self.rows_of(t) if t else 0, dtype=i64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def rows_of(self, tokens: int) -> int:
        """R(T): the sampled rows graph T gathers (no step of T rows samples more)."""
        return logits_bucket(min(tokens, self.max_seqs), self.max_seqs)

    def meta(self, tokens: int) -> AttentionMetadata:
        """The metadata graph T is captured with (and that `run_static` runs with)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:tokens],
            max_query_len=tokens,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            bounds_only=True,
        )

    def _run(self, tokens: int) -> torch.Tensor:
        with forward_context(self.meta(tokens)):
            return self.forward(self.input_ids[:tokens], self.positions[:tokens],
                                self.sampled_rows[: self.rows_of(tokens)])

    def capture(self, pool: Any = None) -> Any:
        """Capture every bucket (the buffers hold no sequence: nothing is attended or
        written); returns the memory pool, shared with the caller's other graphs."""
        for tokens in reversed(self.buckets):
            graph, hidden = capture_graph(pool, self._run, tokens)
            pool = graph.pool()
            self.graphs[tokens] = (graph, hidden)
        torch.cuda.synchronize()
        return pool

    def covers(self, inputs: StepInputs) -> bool:
        return inputs.input_ids.shape[0] in self.buckets

    def load(self, input_ids: torch.Tensor, inputs: StepInputs) -> int:
        """Copy a step's inputs into the graphs' tensors; returns its token bucket."""
        tokens = input_ids.shape[0]
        meta = inputs.meta
        n = meta.seq_lens.shape[0]
        if n > self.max_seqs or tokens not in self.buckets:
            raise ValueError(f"a step of {tokens} rows and {n} sequences has no graph")
        self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:tokens].copy_(meta.slot_mapping, non_blocking=True)
        self.query_start_loc[: n + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[n + 1 :].fill_(inputs.num_tokens)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:].fill_(0)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables,
                                                                  non_blocking=True)
        s = inputs.logits_rows.shape[0]
        self.sampled_rows[:s].copy_(inputs.logits_rows, non_blocking=True)
        self.sampled_rows[s:].fill_(0)
        return tokens

    def replay(self, input_ids: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [S', H] of the step's (padded) sampled rows."""
        graph, hidden = self.graphs[self.load(input_ids, inputs)]
        graph.replay()
        return hidden[: inputs.logits_rows.shape[0]]

    def run_static(self, input_ids: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """What `replay` computes, run eagerly over the same tensors and metadata (how the CPU
        tests check the padding and the bounds-only kernels without a GPU)."""
        tokens = self.load(input_ids, inputs)
        return self._run(tokens)[: inputs.logits_rows.shape[0]]
