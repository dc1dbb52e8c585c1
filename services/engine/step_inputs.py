"""Turn a SchedulerOutput into the flattened tensors of one forward pass.

Rules:
- Built with vectorised numpy over persistent host buffers: no per-token Python loops, only
  generator expressions over the sequences.
- Row order follows `SchedulerOutput.requests`; sequence i owns rows
  query_start_loc[i]:query_start_loc[i+1], and `logits_rows` lists, in order, the last row of
  every sequence that samples this step.
- With `pad` (CUDA), a step that is not decode-only runs a bucketed row count and a bucketed
  sampled-row count (services/engine/row_buckets.py); `num_tokens` / `num_logits` are the real
  counts, the tensors may be longer.
- Two sets of host buffers alternate between steps: a step's (non-blocking) host-to-device copies
  may still be pending while the next step is built (async scheduling), never two steps later.
  Consumers copy what they keep (on CPU the tensors alias the buffers).
- With `states` (hybrid models) the metadata carries each sequence's state slot and whether it
  continues from that slot's state (`state_indices`, `has_initial_state`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from flotilla.services.engine.forward_context import AttentionMetadata
from flotilla.services.engine.row_buckets import logits_bucket, token_bucket
from flotilla.services.engine.scheduler import ScheduledRequest

_num_computed = attrgetter("num_computed_tokens")
_samples = attrgetter("samples")
_state_slot = attrgetter("state_slot")


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # int64 [S'], rows whose logits are sampled (then padding)
    num_tokens: int  # real rows (input_ids may hold padding rows after them)
    num_logits: int  # real sampled rows S


class StepInputBuilder:
    def __init__(
        self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
        device: torch.device, pad: bool = False, states: bool = False,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.pad = pad
        self.states = states
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        sizes = (max_num_tokens, max_num_seqs, max_blocks_per_seq)
        self._buffers = [_HostBuffers(*sizes, pin=device.type == "cuda") for _ in range(2)]
        self._step = 0
        self._arange = np.arange(max(sizes), dtype=np.int64)

    def build(self, requests: list[ScheduledRequest]) -> StepInputs:
        self._step += 1
        buffers = self._buffers[self._step % 2]
        return self._build(requests, buffers)

    def _build(self, requests: list[ScheduledRequest], b: _HostBuffers) -> StepInputs:
        n = len(requests)
        bs = self.block_size
        # Per-sequence values are read with map() over builtins: at 256 decodes a step, generator
        # expressions cost more than all the numpy work below.
        token_lists = [r.token_ids for r in requests]
        block_lists = [r.block_ids for r in requests]
        num_new = np.fromiter(map(len, token_lists), np.int64, n)
        start = np.fromiter(map(_num_computed, requests), np.int64, n)
        qsl = b.query_start_loc[: n + 1]
        qsl[0] = 0
        np.cumsum(num_new, out=qsl[1:])
        t = int(qsl[n])
        b.input_ids[:t] = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, t)
        seq_of_row = np.repeat(self._arange[:n], num_new)
        positions = b.positions[:t]
        np.subtract(self._arange[:t], qsl[seq_of_row], out=positions)
        positions += start[seq_of_row]
        seq_lens = b.seq_lens[:n]
        np.add(start, num_new, out=seq_lens, casting="unsafe")
        max_seq_len = int(seq_lens.max())
        num_cols = -(-max_seq_len // bs)
        table = b.block_tables[: n * num_cols].reshape(n, num_cols)  # contiguous
        table.fill(0)
        num_ids = np.fromiter(map(len, block_lists), np.int64, n)
        if int(num_ids.max()) > num_cols:  # blocks beyond the step's tokens are not read
            block_lists = [ids[:num_cols] for ids in block_lists]
            np.minimum(num_ids, num_cols, out=num_ids)
        table[self._arange[:num_cols] < num_ids[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_lists), np.int32, int(num_ids.sum())
        )
        slots = b.slot_mapping[:t]
        np.multiply(table[seq_of_row, positions // bs], bs, out=slots, casting="unsafe")
        slots += positions % bs
        samples = np.fromiter(map(_samples, requests), np.bool_, n)
        num_logits = int(samples.sum())
        np.subtract(qsl[1:][samples], 1, out=b.logits_rows[:num_logits], casting="unsafe")
        max_query_len = int(num_new.max())
        rows_t, rows_s = t, num_logits
        if self.pad and max_query_len > 1:
            rows_t = token_bucket(t, self.max_num_tokens)
            b.input_ids[t:rows_t] = 0
            b.positions[t:rows_t] = 0
            b.slot_mapping[t:rows_t] = -1  # never written
            if num_logits:
                rows_s = logits_bucket(num_logits, self.max_num_seqs)
                b.logits_rows[num_logits:rows_s] = b.logits_rows[num_logits - 1]

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        state_indices = has_initial_state = None
        if self.states:
            slots = b.state_slots[:n]
            slots[:] = np.fromiter(map(_state_slot, requests), np.int32, n)
            if int(slots.min()) < 0:
                raise ValueError("a request of a hybrid model runs without a state slot")
            state_indices = dev(slots)
            has_initial_state = dev(np.greater(start, 0, out=b.has_initial_state[:n]))
        meta = AttentionMetadata(
            query_start_loc=dev(qsl),
            seq_lens=dev(seq_lens),
            block_tables=dev(table),
            slot_mapping=dev(b.slot_mapping[:rows_t]),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            state_indices=state_indices,
            has_initial_state=has_initial_state,
        )
        return StepInputs(
            input_ids=dev(b.input_ids[:rows_t]),
            positions=dev(b.positions[:rows_t]),
            meta=meta,
            logits_rows=dev(b.logits_rows[:rows_s]),
            num_tokens=t,
            num_logits=num_logits,
        )


class _HostBuffers:
    """One step's host staging arrays (pinned on CUDA, for asynchronous copies)."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 pin: bool) -> None:
        def buf(size: int, dtype: torch.dtype) -> np.ndarray:
            return torch.zeros(size, dtype=dtype, pin_memory=pin).numpy()

        self.input_ids = buf(max_num_tokens, torch.int64)
        self.positions = buf(max_num_tokens, torch.int64)
        self.slot_mapping = buf(max_num_tokens, torch.int64)
        self.query_start_loc = buf(max_num_seqs + 1, torch.int32)
        self.seq_lens = buf(max_num_seqs, torch.int32)
        self.block_tables = buf(max_num_seqs * max_blocks_per_seq, torch.int32)
        self.logits_rows = buf(max_num_seqs, torch.int64)
        self.state_slots = buf(max_num_seqs, torch.int32)
        self.has_initial_state = buf(max_num_seqs, torch.bool)
