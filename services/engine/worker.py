"""A worker rank of a tensor-parallel pod: its shard of the model, driven by rank 0's plans.

Rules:
- A worker owns a full ModelRunner over its shard (same config as rank 0, its own device) and
  never samples, schedules or talks NATS. It runs every forward rank 0 runs, in the same order,
  so the layers' collectives line up: for each StepPlan the step's forward (logits discarded),
  then, with share_tokens, the broadcast of rank 0's sampled tokens, which the next step's
  placeholder inputs read; for each LogitsPlan one prompt-logits forward.
- Start-up mirrors MultiProcExecutor on rank 0: connect the plan channel (when its address is
  known up front), join the process group, learn the channel's address from rank 0 otherwise
  (torchrun), build the runner.
- A worker ends when rank 0 says stop, when rank 0's connection closes, or (spawned workers)
  when its parent process is gone. A worker that fails reports its traceback to rank 0 first and
  exits with status 1, which fails the pod. SIGINT is ignored: a terminal's Ctrl-C reaches rank
  0, which stops the workers. SIGUSR1 prints every thread's stack to stderr (a stuck
  collective shows where).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from flotilla.services.engine.config import EngineConfig
from flotilla.services.engine.distributed import (
    destroy_distributed,
    disable_multicast_env,
    init_distributed,
    tp_broadcast,
    tp_broadcast_object,
)
from flotilla.services.engine.model_runner import ModelRunner
from flotilla.services.engine.plan_channel import Address, PlanClient
from flotilla.services.engine.pod import DEFAULT_TIMEOUT_S, pod_layout
from flotilla.services.engine.step_output import LaunchedStep
from flotilla.services.engine.step_plan import DecodedStep, PlanDecoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker rank needs to start (picklable: it crosses a process spawn)."""

    rank: int
    world_size: int
    init_method: str  # "tcp://host:port" or "env://" (torchrun)
    device: str  # this rank's device: "cpu" or "cuda:N"
    config: EngineConfig
    model_path: str
    timeout_s: float
    num_threads: int | None = None
    plan_address: Address | None = None  # None: rank 0 broadcasts it after the rendezvous
    plan_token: bytes = b""
    watch_parent: bool = False  # exit when the spawning process (rank 0) is gone


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        config = dataclasses.replace(spec.config, device=spec.device)
        self.runner = ModelRunner(config, spec.model_path)
        self._decoder = PlanDecoder()
        self._prev: LaunchedStep | None = None

    @torch.inference_mode()
    def serve(self, channel: PlanClient) -> bool:
        """Run plans until stop (True) or until rank 0 is gone (False)."""
        while True:
            payload = channel.recv()
            if payload is None:
                log.warning("rank 0 closed the plan channel: exiting")
                return False
            plan = self._decoder.decode(payload)
            if plan is None:
                return True
            if isinstance(plan, DecodedStep):
                self._step(plan)
            else:
                self.runner.all_logits(plan)
                self._prev = None

    def _step(self, plan: DecodedStep) -> None:
        self.runner.forward_step(plan.requests, plan.decode_only, self._prev)
        sampling = [r.request_id for r in plan.requests if r.samples]
        if plan.share_tokens and sampling:
            tokens = torch.empty(len(sampling), dtype=torch.int64, device=self.runner.device)
            self._prev = LaunchedStep(sampling, tp_broadcast(tokens))
        else:
            self._prev = None


def _watch_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)  # rank 0 died without stopping us: nothing left to serve

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def run_worker(spec: WorkerSpec) -> None:
    """A worker process's whole life (the target of the executor's spawn, or of torchrun's
    non-zero ranks through `python -m flotilla.services.engine`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where is it stuck?
    if spec.watch_parent:
        _watch_parent()
    disable_multicast_env()
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    channel: PlanClient | None = None
    try:
        if spec.plan_address is not None:
            channel = PlanClient.connect(spec.plan_address, spec.plan_token, spec.rank,
                                         spec.timeout_s)
        init_distributed(spec.rank, spec.world_size, spec.init_method,
                         torch.device(spec.device), spec.timeout_s, spec.config.tp_all_reduce)
        if channel is None:
            address, token = tp_broadcast_object(None)
            channel = PlanClient.connect(address, token, spec.rank, spec.timeout_s)
        worker = Worker(spec)
        stopped = worker.serve(channel)
        del worker  # its CUDA graphs (captured NCCL kernels) before the communicator
    except BaseException:
        text = f"tensor-parallel rank {spec.rank} failed:\n{traceback.format_exc()}"
        log.error("%s", text)
        if channel is not None:
            channel.report(text)
        os._exit(1)  # no clean teardown: peers may be stuck in a collective with us
    if not stopped:
        os._exit(1)
    channel.close()
    destroy_distributed()


def run_torchrun_worker(config: EngineConfig, model_path: str) -> None:
    """A non-zero rank started by torchrun: serve rank 0's pod until it stops."""
    layout = pod_layout(config)
    device = layout.devices[int(os.environ.get("LOCAL_RANK", "0"))]
    threads = config.num_threads
    if threads is None and device == "cpu":
        threads = max(1, (os.cpu_count() or 1) // layout.local_world_size)
    run_worker(WorkerSpec(rank=int(os.environ["RANK"]), world_size=layout.world_size,
                          init_method="env://", device=device, config=config,
                          model_path=model_path, timeout_s=DEFAULT_TIMEOUT_S, num_threads=threads))
