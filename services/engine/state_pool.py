"""Per-sequence recurrent state of linear-attention layers (Gated DeltaNet), beside the paged KV.

A hybrid model (Qwen3-Next, Qwen3.5) keeps, per sequence and per linear-attention layer, a
convolution state [C, W-1] (the last W-1 inputs of its short causal conv1d, model dtype) and a
recurrent state [Hv, Dk, Dv] (fp32). Neither grows with the sequence, so they live in fixed
slots rather than in KV blocks; only the full-attention layers take KV blocks.

Rules:
- `StateSlots` is the bookkeeping (the scheduler's): slots 0..num_slots-1, handed out lowest
  first. A request gets a slot when it is admitted (waiting -> running) and gives it back when it
  finishes or is preempted; `request.state_slot` is -1 while it holds none. A request is not
  admitted while no slot is free.
- `StateCache` owns the tensors (the ModelRunner's): for all layers at once one conv tensor
  [L, S, C, W-1] and one recurrent tensor [L, S, Hv, Dk, Dv], so starting sequences are zeroed
  in one op per tensor; layer i is bound views [S, ...] of both (`bind_state`).
- A sequence's state is only valid for the tokens it has computed: a step that starts a
  sequence (num_computed_tokens 0: new, or recomputed after preemption) zeroes its slot first
  (`reset`), and a prefill chunk continues from the state the previous chunk left. So a
  preempted request restarts from zero state, and prefix caching (which would skip tokens
  whose state is not stored) is off for hybrid models.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Protocol

import torch

from flotilla.services.engine.request import Request

log = logging.getLogger(__name__)

STATE_DTYPE = torch.float32  # the recurrent state; the conv state keeps the model dtype


class StateLayer(Protocol):
    """What a linear-attention layer declares to the runner (layers/gated_delta_net.py)."""

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes (conv state, recurrent state)."""
        ...

    def bind_state(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None: ...


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: lowest slot on top

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request: Request) -> bool:
        """Give `request` a slot (no-op if it holds one); False when none is free."""
        if request.state_slot >= 0:
            return True
        if not self._free:
            return False
        request.state_slot = self._free.pop()
        return True

    def free(self, request: Request) -> None:
        if request.state_slot < 0:
            return
        if request.state_slot in self._free:
            raise RuntimeError(f"state slot {request.state_slot} freed twice")
        self._free.append(request.state_slot)
        self._free.sort(reverse=True)
        request.state_slot = -1


class StateCache:
    def __init__(self, layers: Sequence[StateLayer], num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        conv_shape, state_shape = _common_shapes(layers)
        n = len(layers)
        self.num_slots = num_slots
        self.conv = torch.zeros(n, num_slots, *conv_shape, dtype=dtype, device=device)
        self.recurrent = torch.zeros(n, num_slots, *state_shape, dtype=STATE_DTYPE,
                                     device=device)
        for i, layer in enumerate(layers):
            layer.bind_state(self.conv[i], self.recurrent[i])

    def reset(self, slots: list[int]) -> None:
        """Zero the states of sequences that start in this step."""
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.int64).to(self.conv.device, non_blocking=True)
        self.conv.index_fill_(1, index, 0)
        self.recurrent.index_fill_(1, index, 0)


def state_bytes_per_slot(layers: Sequence[StateLayer], dtype: torch.dtype) -> int:
    """Bytes one sequence's states take over all linear-attention layers."""
    if not layers:
        return 0
    conv_shape, state_shape = _common_shapes(layers)
    elem = torch.empty(0, dtype=dtype).element_size()
    per_layer = math.prod(conv_shape) * elem + math.prod(state_shape) * STATE_DTYPE.itemsize
    return per_layer * len(layers)


def fit_state_slots(wanted: int, per_slot: int, budget: int) -> int:
    """The slots to allocate: `wanted`, but the states take at most half of `budget` bytes
    (the KV cache needs the rest); at least one."""
    slots = max(1, min(wanted, budget // 2 // per_slot))
    if slots < wanted:
        log.warning("the linear-attention state pool holds %d sequences (%.1f MiB each), fewer "
                    "than the %d asked: at most %d run at once", slots, per_slot / 2**20,
                    wanted, slots)
    return slots


def _common_shapes(layers: Sequence[StateLayer]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shapes = {layer.state_shapes() for layer in layers}
    if len(shapes) != 1:
        raise ValueError(f"linear-attention layers of different state shapes: {sorted(shapes)}")
    return shapes.pop()
