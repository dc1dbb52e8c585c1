"""Which of a rank's routed MoE experts live in host memory (llama.cpp's `--cpu-moe` /
`--n-cpu-moe N`, the seeds' `--num-experts-offload-per-rank N`); how they run there is
layers/moe_offload.py, which re-exports these names.

Rules:
- `ExpertOffload` (EngineConfig.expert_offload) says which experts go to the host. In a MoE
  layer of decoder layer `i`, rank r (owning experts [r * E / tp, (r + 1) * E / tp), layers/
  moe.py) keeps ALL its experts on the host when `all_layers` (--cpu-moe) or i < `first_layers`
  (--n-cpu-moe N: decoder layers 0..N-1, whichever of them are MoE, as llama.cpp counts), else
  the LAST `experts_per_rank` of its own experts (--num-experts-offload-per-rank N; an error if
  N is more than it owns). Every rank offloads from its own shard; the rest of the model, the
  router and the shared experts stay on the device.
- `building(offload)` sets the offload of the models built inside it (the loader), and
  `in_layer(i)` the decoder layer whose MoE blocks are being built (models/moe_base.py);
  `placement(prefix, num_local)` is then a MoE layer's split of its local experts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, NamedTuple

OffloadMode = Literal["cpu", "stream"]
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertOffload:
    experts_per_rank: int = 0  # --num-experts-offload-per-rank
    all_layers: bool = False  # --cpu-moe
    first_layers: int = 0  # --n-cpu-moe
    mode: OffloadMode = "cpu"

    def __post_init__(self) -> None:
        if self.experts_per_rank < 0 or self.first_layers < 0:
            raise ValueError("expert offload counts must be >= 0")
        if self.mode not in ("cpu", "stream"):
            raise ValueError(f"MoE offload mode must be cpu or stream, got {self.mode!r}")

    @property
    def active(self) -> bool:
        return self.all_layers or self.first_layers > 0 or self.experts_per_rank > 0

    def host_count(self, layer: int | None, num_local: int) -> int:
        """How many of a rank's `num_local` experts of decoder layer `layer` live on the host."""
        if self.all_layers or (layer is not None and layer < self.first_layers):
            return num_local
        if self.experts_per_rank > num_local:
            raise ValueError(
                f"cannot offload {self.experts_per_rank} experts per rank: a rank "
                f"owns {num_local} experts of MoE layer {layer}"
            )
        return self.experts_per_rank


class ExpertPlacement(NamedTuple):
    """Local experts [0, device) on the device, [device, device + host) on the host."""

    device: int
    host: int


NO_OFFLOAD = ExpertOffload()
_building: ContextVar[ExpertOffload] = ContextVar("expert_offload", default=NO_OFFLOAD)
_layer: ContextVar[int | None] = ContextVar("expert_offload_layer", default=None)


@contextmanager
def building(offload: ExpertOffload) -> Iterator[None]:
    """Models built inside place their experts by `offload` (load_model)."""
    token = _building.set(offload)
    try:
        yield
    finally:
        _building.reset(token)


@contextmanager
def in_layer(layer: int) -> Iterator[None]:
    """MoE blocks built inside belong to decoder layer `layer` (models/moe_base.py)."""
    token = _layer.set(layer)
    try:
        yield
    finally:
        _layer.reset(token)


def layer_index(prefix: str) -> int | None:
    """The decoder layer being built, else the one `prefix` names."""
    if (layer := _layer.get()) is not None:
        return layer
    match = _LAYER_RE.search(prefix)
    return int(match.group(1)) if match else None


def placement(prefix: str, num_local: int) -> ExpertPlacement:
    host = _building.get().host_count(layer_index(prefix), num_local)
    return ExpertPlacement(num_local - host, host)


def current() -> ExpertOffload:
    """The offload of the model being built (NO_OFFLOAD outside `building`)."""
    return _building.get()
