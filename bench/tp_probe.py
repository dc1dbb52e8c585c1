"""Stage-by-stage probe of what a tensor-parallel pod needs from torch.distributed on this host.

    python bench/tp_probe.py [--ranks 2] [--stage-timeout 30]

Spawns N ranks on GPUs 0..N-1 (loopback rendezvous, NVLink multicast off) and runs, each stage
under its own timeout: NCCL init (eager, device bound), an eager all-reduce, an all-gather, a
gloo side group and a host all-reduce on it, a NCCL object broadcast, a CUDA-graph capture and
replay of an all-reduce. Each rank prints one line per stage with its time; a stage that does not
finish in time dumps every thread's stack (faulthandler) and the rank exits, so a hang names its
stage. Exit status 0 when every rank passed every stage.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # spawned ranks import it too

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1"}


def _stage(rank: int, name: str, timeout_s: float, fn: Callable[[], object]) -> None:
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    t = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    faulthandler.cancel_dump_traceback_later()
    print(f"rank {rank}: {name:28s} ok {1e3 * (time.perf_counter() - t):8.1f} ms  {result}",
          flush=True)


def _timings(rank: int, device: torch.device) -> str:
    """Microseconds per bf16 all-reduce in CUDA-graph replays: NCCL vs symmetric memory."""
    from services.engine.symm_all_reduce import SymmAllReduce

    rows = []
    for mode in ("nccl", "one_shot", "two_shot"):
        op = SymmAllReduce(mode, None, device)
        for kib in (8, 64, 512, 4096):
            x = torch.ones(kib * 512, dtype=torch.bfloat16, device=device)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    op(x)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20):
                    op(x)
            x.fill_(1.0)
            g.replay()
            torch.cuda.synchronize()
            ok = float(x[0]) == float(dist.get_world_size() ** 20)  # 20 sums in the graph
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            for _ in range(10):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / 200
            rows.append(f"{mode}:{kib}KiB={us:.1f}us{'' if ok else '(WRONG)'}")
    return " ".join(rows)


def _rank(rank: int, world: int, port: int, timeout_s: float) -> None:
    os.environ.update(ENV)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init = f"tcp://127.0.0.1:{port}"
    _stage(rank, "nccl init (device bound)", timeout_s, lambda: dist.init_process_group(
        "nccl", init_method=init, rank=rank, world_size=world, device_id=device,
        timeout=timedelta(seconds=timeout_s)))
    x = torch.full((1 << 20,), float(rank + 1), device=device)

    def all_reduce() -> float:
        dist.all_reduce(x)
        return float(x[0])

    _stage(rank, "all_reduce eager", timeout_s, all_reduce)

    def all_gather() -> int:
        parts = [torch.empty(4, device=device) for _ in range(world)]
        dist.all_gather(parts, torch.full((4,), float(rank), device=device))
        return int(torch.cat(parts).sum())

    _stage(rank, "all_gather eager", timeout_s, all_gather)

    def min_nccl() -> int:
        t = torch.tensor([100 + rank], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    _stage(rank, "all_reduce MIN (device)", timeout_s, min_nccl)

    def object_bcast() -> object:
        box = [("addr", 1234) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    _stage(rank, "broadcast_object (nccl)", timeout_s, object_bcast)

    def graph() -> float:
        y = torch.ones(4096, device=device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                dist.all_reduce(y)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dist.all_reduce(y)
        y.fill_(1.0)
        g.replay()
        g.replay()
        return float(y[0])

    _stage(rank, "cuda graph all_reduce", timeout_s, graph)

    def gloo() -> int:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        t = torch.tensor([10 + rank])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())

    _stage(rank, "gloo side group + MIN", timeout_s, gloo)
    _stage(rank, "all-reduce timings", timeout_s * 2, lambda: _timings(rank, device))
    _stage(rank, "destroy", timeout_s, dist.destroy_process_group)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--stage-timeout", type=float, default=30.0)
    args = ap.parse_args()
    os.environ.update(ENV)
    if torch.cuda.device_count() < args.ranks:
        sys.exit(f"needs {args.ranks} GPUs, found {torch.cuda.device_count()}")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.stage_timeout))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(args.stage_timeout * 8)
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    print("exit codes", codes, flush=True)
    sys.exit(0 if all(c == 0 for c in codes) else 1)


if __name__ == "__main__":
    main()
