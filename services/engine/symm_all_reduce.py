"""Small all-reduces over symmetric memory: one kernel, no NCCL protocol round, graph-capturable.

Decode at small batches all-reduces a few KB twice per layer; NCCL's latency for that (~10-15 us
on NVLink) is most of what tensor parallelism adds to a token. torch's symmetric memory maps every
rank's copy of one buffer into each rank's address space (CUDA IPC over NVLink, no multicast), so
`one_shot_all_reduce` is one kernel that reads the peers' buffers directly and syncs through
signal pads; it is safe inside CUDA graphs.

Rules:
- Mode (EngineConfig.tp_all_reduce / FLOTILLA_TP_ALL_REDUCE): "nccl" always NCCL; "one_shot" /
  "two_shot" symmetric memory for messages up to SYMM_MAX_BYTES, NCCL above; "auto" = one_shot
  for messages up to ONE_SHOT_MAX_BYTES (latency-bound), NCCL above (bandwidth-bound: prefill).
- One buffer per dtype, created on first use. Its rendezvous is a collective, so every rank must
  reach it at the same point: the first all-reduce of that dtype, which the ranks issue in the
  same order (a profiling or warm-up forward, never inside a graph capture: captures follow
  warm-ups). A setup failure (no P2P, old driver) falls back to NCCL for good, on every rank
  alike (the ranks agree on it with one NCCL all-reduce).
- Only CUDA tensors that are contiguous; anything else goes to NCCL.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SYMM_MAX_BYTES = 4 << 20  # each dtype's buffer
ONE_SHOT_MAX_BYTES = 512 << 10  # auto: above this NCCL's ring wins (prefill activations)
MODES = ("auto", "nccl", "one_shot", "two_shot")


class SymmAllReduce:
    def __init__(self, mode: str, group: dist.ProcessGroup | None, device: torch.device) -> None:
        if mode not in MODES:
            raise ValueError(f"tp_all_reduce must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.group = group or dist.group.WORLD
        self.device = device
        self.group_name = self.group.group_name  # type: ignore[union-attr]
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._broken = mode == "nccl" or device.type != "cuda"

    def _limit(self) -> int:
        return ONE_SHOT_MAX_BYTES if self.mode == "auto" else SYMM_MAX_BYTES

    def _buffer(self, dtype: torch.dtype) -> torch.Tensor | None:
        buf = self._buffers.get(dtype)
        if buf is not None or self._broken:
            return buf
        error = ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            size = SYMM_MAX_BYTES // torch.empty(0, dtype=dtype).element_size()
            buf = symm_mem.empty(size, dtype=dtype, device=self.device)
            symm_mem.rendezvous(buf, self.group_name)
        except Exception as exc:  # noqa: BLE001 - any failure means: use NCCL
            error = repr(exc)
        ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not int(ok.item()):
            log.warning("symmetric-memory all-reduce unavailable (%s): using NCCL",
                        error or "failed on another rank")
            self._broken = True
            return None
        assert buf is not None
        self._buffers[dtype] = buf
        log.info("symmetric-memory all-reduce for %s (mode %s, up to %d KiB)", dtype, self.mode,
                 self._limit() >> 10)
        return buf

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place."""
        nbytes = x.numel() * x.element_size()
        buf = None
        if not self._broken and x.is_cuda and x.is_contiguous() and nbytes <= self._limit():
            buf = self._buffer(x.dtype)
        if buf is None:
            dist.all_reduce(x, group=self.group)
            return x
        flat, staged = x.view(-1), buf[: x.numel()]
        staged.copy_(flat)
        if self.mode == "two_shot":
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            flat.copy_(staged)
        else:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return x
