"""Tensor-parallel group state: which rank this process is and how many ranks share each layer.

Rules:
- World size 1 is the default and needs no torch.distributed; every helper is a no-op there.
- A pod's ranks join with `init_distributed` (torch.distributed: NCCL on CUDA, gloo on CPU); the
  host-side agreements (KV block count, the plan channel's address) use the same group, so a
  GPU pod needs no gloo side group (gloo picks its network interface from the host name, which
  can hang on hosts whose name does not resolve to a reachable address). Tests that build
  models by hand may call `init_tensor_parallel(rank, size, group)` on a group of their own.
  Either happens once, before building the model: layers read `get_tp_rank()` /
  `get_tp_size()` at construction time to size their shards, so the group must not change
  after a model is built. `destroy_distributed` returns the process to world size 1.
- Collectives run on the group given at init (None = the default process group). Every rank
  issues the same collectives in the same order; the device collectives of a forward come from
  the layers, the rest (KV block count, sampled tokens) from the executor and the runner.
- NVLink multicast (NVLS) stays off in every rank: `disable_multicast_env` sets the variables
  before NCCL starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flotilla.services.engine.symm_all_reduce import SymmAllReduce

MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class _TPState:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    device: torch.device | None = None  # where host values travel for collectives (NCCL: GPU)
    backend: str | None = None  # set when init_distributed created the process group
    all_reduce: SymmAllReduce | None = None  # NCCL pods: small messages over symmetric memory


_STATE = _TPState()


def init_tensor_parallel(rank: int, size: int, group: dist.ProcessGroup | None = None,
                         device: torch.device | None = None) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank {rank} for size {size}")
    if size > 1 and not dist.is_initialized():
        raise RuntimeError("tensor parallelism > 1 needs torch.distributed initialised first")
    _STATE.rank, _STATE.size, _STATE.group, _STATE.device = rank, size, group, device


def disable_multicast_env() -> None:
    for key, value in MULTICAST_OFF_ENV.items():
        os.environ.setdefault(key, value)


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     timeout_s: float, all_reduce: str = "auto") -> None:
    """Join the pod's process group (NCCL on CUDA, gloo on CPU) and make it the tensor-parallel
    group. `init_method`: "tcp://host:port" (ranks started by the executor) or "env://"
    (torchrun's MASTER_ADDR / MASTER_PORT). `timeout_s` bounds every collective."""
    disable_multicast_env()
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device)
        _STATE.backend = "nccl"
        _STATE.all_reduce = SymmAllReduce(all_reduce, None, device)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
        _STATE.backend = "gloo"
    init_tensor_parallel(rank, world_size, None, device if device.type == "cuda" else None)


def abort_distributed() -> None:
    """Best effort: make NCCL operations waiting on a dead rank fail instead of hanging (gloo
    ones fail by themselves when a peer's connection closes)."""
    if _STATE.backend == "nccl" and dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - already aborting; nothing better to do
            pass


def destroy_distributed() -> None:
    """Leave the process group and return to world size 1 (so the process can build a
    single-rank model again). NCCL groups are aborted, not destroyed: every rank is leaving
    (or one is dead after a failure), and a clean NCCL teardown can block for good — on 2×H200
    (torch 2.11, NCCL 2.28) a pod that had replayed CUDA graphs holding NCCL kernels never
    returned from `destroy_process_group`, while eager pods did. Abort does not wait on peers.
    Gloo groups are destroyed."""
    if _STATE.backend == "nccl":
        abort_distributed()
    elif _STATE.backend is not None and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.rank, _STATE.size, _STATE.group, _STATE.device = 0, 1, None, None
    _STATE.backend, _STATE.all_reduce = None, None


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
        if _STATE.all_reduce is not None:
            return _STATE.all_reduce(x)
        dist.all_reduce(x, group=_STATE.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`, rank order; identity at world size 1."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.group)
    return torch.cat(parts, dim=dim)


def tp_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` on every rank (device tensors: in place, queued on the stream)."""
    if _STATE.size > 1:
        dist.broadcast(x, src=src, group=_STATE.group)
    return x


def tp_min(value: int) -> int:
    """The smallest of every rank's `value` (host ints, e.g. the KV blocks each rank can hold)."""
    if _STATE.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_STATE.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.group)
    return int(t.item())


def tp_broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s picklable `obj` on every rank (through the current device on NCCL)."""
    if _STATE.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_STATE.group, device=_STATE.device)
    return box[0]
