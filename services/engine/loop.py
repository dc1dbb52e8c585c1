"""Runs the Engine's step loop on its own thread, next to the asyncio service.

Rules:
- Only the loop thread touches the Engine. With an `executor` (one thread: the service builds
  the engine there first), the loop runs on that thread: on CPU each thread that runs torch's
  parallel ops keeps its own OpenMP pool, and a second pool spinning beside the stepping one
  on the same cores made every parallel op pay a wake-up (one int4 decode matmul 32 µs with one
  pool, 78-99 µs with two). The asyncio side submits commands (add, abort)
  through a thread-safe queue and receives each step's outputs through `on_outputs`, called on
  the event loop with `call_soon_threadsafe`.
- When there is no work the thread blocks on the command queue, so an idle engine burns no CPU.
- Admission window: when a request wakes an idle engine, the loop holds it (and whatever
  follows) until `admit_window_s` passes without another arrival, or `admit_window_max_s` after
  the first, then hands them all to the engine at once. A burst reaching the engine over tens
  of ms (64 streams through HTTP and two NATS hops: 30-120 ms on an H100 host) then shares its
  first prefill step instead of ~10 partial ones; a lone request waits `admit_window_s`. A busy
  engine takes what arrived at its next step. (Holding arrivals while busy too, until they
  pause, was measured worse on the H100: suite/engine 0.938-0.949 vs 0.956-0.964.)
- A crash inside `step()` fails every request in flight (through `on_crash`) rather than
  leaving them hanging. A request the engine refuses when it is added (add_request raises)
  fails alone: it comes back as an error output.
- A step that scheduled nothing and produced nothing (everything waits for room) is followed
  by a short wait for commands (IDLE_WAIT_S) rather than a busy spin; each step expires the
  requests whose deadline passed, waiting ones included (Engine.expire_deadlines).
- Queue state for admission (`queue_state`, any thread): the engine's waiting requests and
  prompt tokens as of its last step, plus those handed to the loop since (counted when `add`
  is called, so a burst between two steps is counted at once), and the engine's recent rate in
  tokens per second (an average over steps that computed tokens). Pooling jobs (PoolingParams)
  are not counted: they have their own bound (pool_service.py).
- Heartbeat: the thread notes the time every time round (each step, and every `idle_beat_s`
  while it waits for work); `stats()["heartbeat"]` carries it (monotonic clock, shared by the
  processes of one host), so a loop wedged inside a step is seen by /ready however healthy
  the process's event loop looks.
- `step_log`: a file that gets one JSON line per step (when it ran, how long step() took and
  its phases, garbage collection time in the process since the previous step, what was
  scheduled, what came out, when the requests it took arrived), for looking at how a burst was
  admitted and where a slow step went.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from flotilla.libs.common.settings import EngineSettings
from flotilla.services.engine.engine import RequestOutput
from flotilla.services.engine.pooling import PoolingParams
from flotilla.services.engine.request_error import RequestError
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005
RATE_WEIGHT = 0.2  # weight of the latest step in the tokens-per-second average


@dataclass
class QueueState:
    waiting: int  # requests waiting for their first step
    waiting_tokens: int  # their tokens still to compute
    tokens_per_s: float  # the engine's recent rate (0: not measured yet)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams | None
    priority: int = 0
    deadline: float | None = None
    t: float = field(default_factory=time.time)  # handed to the loop (step log)
    counted: bool = True  # in queue_state (generation; pooling jobs are not)


@dataclass
class _Abort:
    request_id: str


class SteppedEngine(Protocol):
    """What the step loop needs from an engine: `Engine` (engine.py) is one; tests use small
    stand-ins. Every method is called from the loop's thread only."""

    @property
    def last_scheduled(self) -> SchedulerOutput | None:
        """The latest step's plan (None before the first step)."""

    @property
    def last_phases(self) -> tuple[float, ...]:
        """The latest step's phases in seconds (for the step log)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                    deadline: float | None = None) -> None: ...

    def abort(self, request_id: str) -> bool | None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> dict[str, Any]: ...

    def prepare_thread(self) -> None:
        """Build what the engine keeps per thread, on the thread that will step it."""


class EngineLoop:
    idle_beat_s = 0.5  # an idle loop wakes this often to show it is alive

    def __init__(self, engine: SteppedEngine, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[RequestOutput]], None],
                 on_crash: Callable[[BaseException], None], admit_window_s: float = 0.0,
                 admit_window_max_s: float | None = None, step_log: str | None = None,
                 executor: Executor | None = None):
        self.engine = engine
        self._executor = executor
        self._future: Future[None] | None = None
        self.admit_window_s = admit_window_s
        self.admit_window_max_s = max(admit_window_s, admit_window_max_s or admit_window_s)
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_crash = on_crash
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stats: dict[str, Any] = {}
        self._stats_lock = threading.Lock()
        self._held: list[_Add] = []  # arrivals waiting for the admission window to close
        self._held_since = 0.0  # monotonic time of the first held arrival
        self._last_arrival = 0.0
        self._step_log_path = step_log
        self._step_log: IO[str] | None = None
        self._arrivals: list[float] = []  # when the requests added since the last step came
        self._gc_ms = 0.0  # garbage collection time (any thread) since the last step
        self._gc_start = 0.0
        self._beat = time.monotonic()
        # requests / tokens given to `add` but not yet in the engine's stats (under the stats
        # lock), and those the loop thread handed to the engine since its last stats refresh
        self._queued = [0, 0]
        self._handed = [0, 0]
        self._rate = 0.0  # tokens per second, averaged over steps
        self._idle = False  # the last step did nothing
        # called from this loop's thread after every step with (seconds, SchedulerOutput): the
        # engine's step metrics (metrics.py)
        self.on_step: Callable[[float, Any], None] | None = None

    @classmethod
    def for_service(cls, engine: SteppedEngine, loop: asyncio.AbstractEventLoop,
                    on_outputs: Callable[[list[RequestOutput]], None],
                    on_crash: Callable[[BaseException], None],
                    settings: EngineSettings, executor: Executor | None = None) -> EngineLoop:
        """The loop an engine service runs (on `executor`'s thread, where it built the engine)."""
        return cls(engine, loop, on_outputs, on_crash,
                   admit_window_s=settings.admit_window_ms / 1000,
                   admit_window_max_s=settings.admit_window_max_ms / 1000,
                   step_log=settings.step_log, executor=executor)

    def start(self) -> None:
        if self._executor is not None:
            self._future = self._executor.submit(self._run)
        else:
            self._thread.start()

    def stop(self) -> None:
        self._commands.put(None)
        if self._future is not None:
            wait([self._future], timeout=10)
        else:
            self._thread.join(timeout=10)

    def add(self, request_id: str, prompt_token_ids: list[int],
            params: SamplingParams | PoolingParams | None, priority: int = 0,
            deadline: float | None = None) -> None:
        counted = not isinstance(params, PoolingParams)
        if counted:
            with self._stats_lock:
                self._queued[0] += 1
                self._queued[1] += len(prompt_token_ids)
        self._commands.put(_Add(request_id, prompt_token_ids, params, priority, deadline,
                                counted=counted))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step (a copy; safe from any thread)."""
        with self._stats_lock:
            return {**self._stats, "heartbeat": self._beat}

    def queue_state(self) -> QueueState:
        with self._stats_lock:
            return QueueState(self._stats.get("waiting", 0) + self._queued[0],
                              self._stats.get("waiting_tokens", 0) + self._queued[1],
                              self._rate)

    def _refresh_stats(self) -> None:
        stats = self.engine.stats()
        stats["tokens_per_s"] = self._rate
        with self._stats_lock:
            self._stats = stats
            self._queued[0] -= self._handed[0]
            self._queued[1] -= self._handed[1]
        self._handed = [0, 0]

    def _note_rate(self, dt: float) -> None:
        sched = self.engine.last_scheduled
        tokens = sched.num_batched_tokens if sched is not None else 0
        if tokens and dt > 0:
            rate = tokens / dt
            self._rate = rate if not self._rate else (
                RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * self._rate)

    # ------------------------------------------------------------------ admission

    def _take(self, cmd: _Add | _Abort, now: float) -> None:
        """A command off the queue: adds are held (or applied at once without a window),
        aborts applied, or dropped with the held add they cancel."""
        if isinstance(cmd, _Abort):
            for i, held in enumerate(self._held):
                if held.request_id == cmd.request_id:
                    del self._held[i]  # never reached the engine: nothing to free
                    self._count_handed(held)
                    return
            self.engine.abort(cmd.request_id)
            return
        if self.admit_window_s <= 0:
            self._add(cmd)
            return
        if not self._held:
            self._held_since = now
        self._held.append(cmd)
        self._last_arrival = now

    def _window_closes(self) -> float:
        """When the held arrivals join the engine (monotonic time)."""
        return min(self._last_arrival + self.admit_window_s,
                   self._held_since + self.admit_window_max_s)

    def _release(self) -> None:
        held, self._held = self._held, []
        for cmd in held:
            self._add(cmd)

    def _count_handed(self, cmd: _Add) -> None:
        if cmd.counted:
            self._handed[0] += 1
            self._handed[1] += len(cmd.prompt_token_ids)

    def _add(self, cmd: _Add) -> None:
        self._count_handed(cmd)
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                    cmd.priority, cmd.deadline)
        except Exception as exc:  # noqa: BLE001 - one request the engine refuses fails alone
            error = RequestError.of(exc, "adding the request")
            out = RequestOutput(cmd.request_id, [], True, "error", len(cmd.prompt_token_ids),
                                0, 0, error=error)
            self._loop.call_soon_threadsafe(self._on_outputs, [out])
            return
        if self._step_log is not None:
            self._arrivals.append(cmd.t)

    def _admit(self) -> bool:
        """Take the queued commands. A busy engine gets the held arrivals now; an idle one
        sleeps until a command comes, then until the admission window closes. False once stop
        was requested."""
        while True:
            busy = self.engine.has_unfinished()
            if busy or not self._held:
                # None: sleep until a command
                timeout: float | None = (IDLE_WAIT_S if self._idle else 0.0) if busy else None
            else:
                timeout = self._window_closes() - time.monotonic()
            try:
                cmd = (self._commands.get(timeout=self.idle_beat_s) if timeout is None
                       else self._commands.get(timeout=timeout) if timeout > 0
                       else self._commands.get_nowait())
            except queue.Empty:  # idle (still alive), busy, or the window closed
                if timeout is None:
                    self._beat = time.monotonic()
                    continue
                self._release()
                return True
            if cmd is None:
                return False
            self._take(cmd, time.monotonic())

    # ------------------------------------------------------------------ the thread

    def _log_step(self, t0: float, dt: float, outputs: list[Any]) -> None:
        assert self._step_log is not None
        sched = self.engine.last_scheduled
        requests = sched.requests if sched is not None else []
        phases = self.engine.last_phases
        gc_ms, self._gc_ms = self._gc_ms, 0.0
        self._step_log.write(json.dumps({
            "t": round(t0, 6), "step_ms": round(dt * 1e3, 3),
            "phases_ms": [round(p * 1e3, 3) for p in phases], "gc_ms": round(gc_ms, 3),
            "added": len(self._arrivals), "tokens": sched.num_batched_tokens if sched else 0,
            "seqs": len(requests), "prefills": sum(r.is_prefill for r in requests),
            "outputs": len(outputs),
            "first_tokens": sum(o.num_output_tokens == 1 for o in outputs
                                if o.new_token_ids),
            "arrivals": [round(t, 4) for t in self._arrivals]}) + "\n")
        self._arrivals.clear()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_ms += (time.perf_counter() - self._gc_start) * 1e3

    def _run(self) -> None:
        self._refresh_stats()
        if self._step_log_path:
            self._step_log = open(self._step_log_path, "a", buffering=1 << 16)  # noqa: SIM115
            gc.callbacks.append(self._on_gc)
        try:
            # per-thread caches (cuDNN attention plans, FLOTILLA_DENSE_PREFILL) belong to the
            # thread that steps the engine, not to the one that built it
            self.engine.prepare_thread()
            while True:
                self._beat = time.monotonic()
                if not self._admit():
                    return
                if not self.engine.has_unfinished():
                    self._refresh_stats()
                    continue
                t0 = time.time()
                outputs = self.engine.step()
                dt = time.time() - t0
                self._note_rate(dt)
                sched = self.engine.last_scheduled
                self._idle = not outputs and sched is not None and sched.is_empty
                # stats first: whoever sees a request's output sees a queue without it
                self._refresh_stats()
                if self.on_step is not None:
                    self.on_step(dt, sched)
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)
                if self._step_log is not None:
                    self._log_step(t0, dt, outputs)
                    if not self.engine.has_unfinished():  # going idle: write it out
                        self._step_log.flush()
        except BaseException as exc:  # the engine is broken: fail everything, don't hang
            log.exception("engine loop crashed")
            self._loop.call_soon_threadsafe(self._on_crash, exc)
        finally:
            if self._step_log is not None:
                gc.callbacks.remove(self._on_gc)
                self._step_log.close()
