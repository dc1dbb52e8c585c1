"""MultiProcExecutor: rank 0's side of a tensor-parallel pod.

Rules:
- Rank 0 is this process: it schedules, talks NATS and samples. Each call first sends its plan
  (step_plan.py) to the other ranks over the plan channel, then runs rank 0's part: every rank
  runs the same forward (the layers' collectives line up) and only rank 0 samples. With async
  scheduling rank 0 broadcasts each step's sampled tokens, which the workers feed to the next
  step like rank 0 does (placeholder inputs).
- The ranks agree on one KV block count (the smallest any rank can hold), so the scheduler's
  block ids are valid everywhere.
- Ranks are started here (one host: N-1 spawned worker processes, rendezvous on loopback) or by
  torchrun (several hosts: env:// rendezvous; this process is RANK 0, the other ranks run
  `python -m flotilla.services.engine`, which makes them workers). NCCL on CUDA, gloo on CPU.
- A rank failing fails the pod, there is no recovery: a monitor thread sees a worker exit, its
  connection close or its error report within milliseconds, aborts NCCL (so no rank waits on a
  collective forever; gloo fails by itself), and runs the `on_failure` callbacks at once (the
  engine thread may be stuck in a collective). From then on `launch`, `all_logits` and a launched
  step's `result()` raise TensorParallelError. Collectives also time out after `timeout_s`.
- `shutdown` stops the workers (stop plan, then kill stragglers) and returns the process to
  world size 1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.process import BaseProcess

import torch

from flotilla.services.engine.config import EngineConfig
from flotilla.services.engine.distributed import (
    abort_distributed,
    destroy_distributed,
    disable_multicast_env,
    init_distributed,
    tp_broadcast,
    tp_broadcast_object,
)
from flotilla.services.engine.executor import Executor, TensorParallelError
from flotilla.services.engine.model_runner import ModelRunner
from flotilla.services.engine.plan_channel import PlanServer, recv_frame
from flotilla.services.engine.pod import DEFAULT_TIMEOUT_S, PodLayout, free_port, plan_hosts
from flotilla.services.engine.scheduler import ScheduledRequest
from flotilla.services.engine.step_output import LaunchedStep, RunnerOutput
from flotilla.services.engine.step_plan import PlanEncoder
from flotilla.services.engine.worker import WorkerSpec, run_worker

log = logging.getLogger(__name__)


def _no_check() -> None:
    pass


@dataclass
class _CheckedStep(LaunchedStep):
    """A LaunchedStep whose result() raises if a rank failed while it ran (its tokens could be
    garbage after an abort)."""

    check: Callable[[], None] = _no_check

    @classmethod
    def of(cls, step: LaunchedStep, check: Callable[[], None]) -> _CheckedStep:
        return cls(**{f.name: getattr(step, f.name) for f in dataclasses.fields(step)},
                   check=check)

    def result(self) -> RunnerOutput:
        out = super().result()
        self.check()
        return out


class MultiProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path: str, layout: PodLayout,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        disable_multicast_env()  # before any rank (or NCCL) starts
        self.world_size = layout.world_size
        self._failure: TensorParallelError | None = None
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._lock = threading.Lock()
        self._closing = self._closed = False
        self._procs: dict[int, BaseProcess] = {}
        self._server: PlanServer | None = None
        self._monitor: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._encoder = PlanEncoder()
        device = torch.device(layout.devices[0])
        self._share_tokens = (config.async_scheduling if config.async_scheduling is not None
                              else device.type == "cuda")
        self._threads_before = torch.get_num_threads()
        threads = config.num_threads
        if threads is None and device.type == "cpu":
            threads = max(1, (os.cpu_count() or 1) // layout.local_world_size)
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            if layout.torchrun:
                init_distributed(0, self.world_size, "env://", device, timeout_s,
                                 config.tp_all_reduce)
                bind, advertise = plan_hosts(layout)
                self._server = PlanServer(bind, advertise, self.world_size - 1)
                tp_broadcast_object((self._server.address, self._server.token))
                self._server.accept(timeout_s)
            else:
                self._server = PlanServer("127.0.0.1", "127.0.0.1", self.world_size - 1)
                init_method = f"tcp://127.0.0.1:{free_port()}"
                self._spawn(config, model_path, layout, init_method, timeout_s, threads)
                self._server.accept(timeout_s, self._check_started)
                init_distributed(0, self.world_size, init_method, device, timeout_s,
                                 config.tp_all_reduce)
            self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
            self._monitor.start()
            self.runner = ModelRunner(dataclasses.replace(config, device=str(device)),
                                      model_path)
        except BaseException as exc:
            failure = self._failure  # a worker failed first: its report says why
            self.shutdown()
            if failure is not None:
                raise TensorParallelError(str(failure)) from exc
            raise
        log.info("tensor-parallel pod of %d ranks ready (%s)", self.world_size,
                 ", ".join(layout.devices))

    # ------------------------------------------------------------------ start

    def _spawn(self, config: EngineConfig, model_path: str, layout: PodLayout,
               init_method: str, timeout_s: float, threads: int | None) -> None:
        assert self._server is not None
        ctx = torch.multiprocessing.get_context("spawn")
        for rank in range(1, self.world_size):
            spec = WorkerSpec(rank=rank, world_size=self.world_size, init_method=init_method,
                              device=layout.devices[rank], config=config, model_path=model_path,
                              timeout_s=timeout_s, num_threads=threads,
                              plan_address=self._server.address, plan_token=self._server.token,
                              watch_parent=True)
            proc = ctx.Process(target=run_worker, args=(spec,), name=f"flotilla-tp{rank}",
                               daemon=True)
            proc.start()
            self._procs[rank] = proc

    def _check_started(self) -> None:
        for rank, proc in self._procs.items():
            if not proc.is_alive():
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with code "
                                          f"{proc.exitcode} while starting")

    # ------------------------------------------------------------------ failures

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        self._callbacks.append(callback)
        if self._failure is not None:
            callback(self._failure)

    def _watch(self) -> None:
        """Monitor thread: the first worker exit, report or closed connection fails the pod."""
        assert self._server is not None
        sockets = {conn: rank for rank, conn in self._server.workers.items()}
        sentinels = {proc.sentinel: rank for rank, proc in self._procs.items()}
        ready = connection.wait([*sockets, *sentinels, self._wake_r])
        if self._closing or self._wake_r in ready:
            return
        obj = next((o for o in ready if o in sockets), ready[0])
        rank = sockets[obj] if obj in sockets else sentinels[obj]  # type: ignore[index]
        self._fail(self._reason(rank))

    def _reason(self, rank: int) -> str:
        """The worker's own report if it sent one, else how it ended."""
        assert self._server is not None
        conn = self._server.workers.get(rank)
        if conn is not None and select.select([conn], [], [], 0.5)[0]:
            try:
                payload = recv_frame(conn)
            except OSError:
                payload = None
            if payload:
                return payload.decode(errors="replace")
        proc = self._procs.get(rank)
        if proc is not None:
            proc.join(1.0)
            if proc.exitcode is not None:
                code = proc.exitcode
                how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                       else f"exited with code {code}")
                return f"tensor-parallel rank {rank} {how}"
        return f"tensor-parallel rank {rank} closed its connection"

    def _fail(self, message: str) -> TensorParallelError:
        with self._lock:
            if self._failure is not None:
                return self._failure
            self._failure = TensorParallelError(message)
            failure = self._failure
        if self._closing:
            return failure
        log.error("%s", message)
        abort_distributed()
        for callback in list(self._callbacks):
            try:
                callback(failure)
            except Exception:  # noqa: BLE001 - one broken callback must not hide the others
                log.exception("tensor-parallel failure callback raised")
        return failure

    def _wait_failure(self, timeout_s: float) -> TensorParallelError | None:
        deadline = time.monotonic() + timeout_s
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._failure

    def _check(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(str(self._failure))
        if self._closed:
            raise TensorParallelError("the tensor-parallel executor is shut down")

    def _failed_because(self, exc: BaseException) -> TensorParallelError:
        """An error in rank 0's part of a call: the ranks are out of step, so the pod has
        failed. A dead worker is usually the cause: give the monitor a moment to say which."""
        failure = self._wait_failure(2.0)
        if failure is None:
            failure = self._fail(f"tensor-parallel rank 0 failed: {exc!r}")
        return TensorParallelError(str(failure))

    # ------------------------------------------------------------------ calls

    def launch(self, requests: list[ScheduledRequest], decode_only: bool,
               prev: LaunchedStep | None = None) -> LaunchedStep:
        self._check()
        assert self._server is not None
        try:
            self._server.broadcast(self._encoder.step(requests, decode_only, self._share_tokens))
            launched = self.runner.launch(requests, decode_only, prev)
            if self._share_tokens and launched.tokens is not None:
                tp_broadcast(launched.tokens)
        except Exception as exc:
            raise self._failed_because(exc) from exc
        return _CheckedStep.of(launched, self._check)

    def all_logits(self, request: ScheduledRequest) -> torch.Tensor:
        self._check()
        assert self._server is not None
        try:
            self._server.broadcast(PlanEncoder.logits(request))
            logits = self.runner.all_logits(request)
        except Exception as exc:
            raise self._failed_because(exc) from exc
        self._check()
        return logits

    # ------------------------------------------------------------------ stop

    def shutdown(self, grace_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = self._closing = True
        if self._server is not None:
            try:
                self._server.broadcast(PlanEncoder.stop())
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in self._procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        os.write(self._wake_w, b"x")
        if self._monitor is not None:
            self._monitor.join(2.0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._server is not None:
            self._server.close()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.release_graphs()  # captured NCCL kernels go before the communicator does
        destroy_distributed()
        torch.set_num_threads(self._threads_before)

