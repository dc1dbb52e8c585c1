"""The layout of a tensor-parallel pod: how many ranks, and which device each rank of this host
uses. Rules (docs/tensor_parallel.md):
- `tp` ranks, else one per entry of `device_ids`, else torchrun's WORLD_SIZE (env://), else 1.
- On CUDA, local rank r runs on GPU device_ids[r] (default r); on CPU every rank is "cpu".
- Inconsistent settings raise ValueError at start-up, naming them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flotilla.services.engine.config import EngineConfig

DEFAULT_TIMEOUT_S = 300.0  # collectives, rendezvous, workers connecting


@dataclass(frozen=True)
class PodLayout:
    """How many ranks, and where this host's ranks run."""

    world_size: int
    devices: list[str]  # per local rank: "cpu" or "cuda:N"
    torchrun: bool  # ranks started by torchrun (env://), not by us

    @property
    def local_world_size(self) -> int:
        return len(self.devices)


def pod_layout(config: EngineConfig) -> PodLayout:
    """tp (or the number of device_ids, or torchrun's WORLD_SIZE) ranks; rank r of this host on
    device_ids[r] (default: GPU r). Raises ValueError on inconsistent settings."""
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    torchrun = env_world > 1 and "RANK" in os.environ
    ids = list(config.device_ids) if config.device_ids else None
    if torchrun:
        world = env_world
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if config.tp not in (None, world):
            raise ValueError(f"tp={config.tp} but torchrun started {world} ranks")
    else:
        world = config.tp or (len(ids) if ids else 1)
        local_world = world
        if ids is not None and len(ids) != world:
            raise ValueError(f"tp={world} needs one device id per rank, got {ids}")
    device = config.resolved_device
    if not device.startswith("cuda"):
        return PodLayout(world, ["cpu"] * local_world, torchrun)
    if ids is None:
        if ":" in device and world > 1:
            raise ValueError(f"device {device} names one GPU; give device_ids for {world} ranks")
        ids = [int(device.split(":")[1])] if ":" in device else list(range(local_world))
    if len(ids) < local_world:
        raise ValueError(f"{local_world} ranks on this host but device_ids {ids}")
    return PodLayout(world, [f"cuda:{i}" for i in ids[:local_world]], torchrun)



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plan_hosts(layout: PodLayout) -> tuple[str, str]:
    """(bind, advertise) for the plan channel: loopback when every rank shares this host, else
    every interface, advertised as the address this host uses toward MASTER_ADDR."""
    if layout.local_world_size == layout.world_size:
        return "127.0.0.1", "127.0.0.1"
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
        ip = str(s.getsockname()[0])
    if ip.startswith("127."):
        ip = socket.gethostbyname(socket.gethostname())
    return "0.0.0.0", ip
