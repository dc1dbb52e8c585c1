"""Tensor-parallel group state: which rank this process is and how many ranks share each layer.

Rules:
- World size 1 is the default and needs no torch.distributed; every helper is a no-op there.
- The launcher (or a test) calls `init_tensor_parallel(rank, size, group)` once, before building
  the model. Layers read `get_tp_rank()` / `get_tp_size()` at construction time to size their
  shards, so the group must not change after a model is built.
- Collectives run on the group given at init (None = the default process group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _TPState:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


_STATE = _TPState()


def init_tensor_parallel(rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank {rank} for size {size}")
    if size > 1 and not dist.is_initialized():
        raise RuntimeError("tensor parallelism > 1 needs torch.distributed initialised first")
    _STATE.rank, _STATE.size, _STATE.group = rank, size, group


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by tensor-parallel size "
                         f"{denominator}")
    return numerator // denominator


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks, in place; identity at world size 1."""
    if _STATE.size > 1:
        dist.all_reduce(x, group=_STATE.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`, rank order; identity at world size 1."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.group)
    return torch.cat(parts, dim=dim)
