"""The engine and its step loop in a child process (`FLOTILLA_CORE_PROCESS`, off by default).

In one process, the step loop thread and the NATS event loop share a GIL. Every torch call
drops the GIL and takes it back, and a busy event loop (a burst of arrivals, 64 token frames a
step) keeps it for up to the switch interval each time, so launches stall while requests
arrive. With the core in its own process the event loop's work never delays a launch.

Rules:
- `CoreProcess` stands where EngineService keeps its Engine and its EngineLoop: `vocab_size`,
  `max_model_len`, `add`, `abort`, `stats`, `stop`. It spawns the child, waits until the
  engine is built (a build failure raises from `start`), and talks to it over one pipe.
- Parent -> child: ("add", request id, prompt ids, SamplingOptions JSON), ("abort", id),
  ("stop",). A sender thread writes them, so a full pipe never blocks the event loop.
- Child -> parent: ("ready", info), ("out", [RequestOutput]), ("stats", dict) every 0.25 s,
  ("refused", id, message) when options fail to convert there (a grammar that does not
  compile; everything else was checked by the parent first), ("crash", message). A reader
  thread hands them to the event loop.
- The child converts the options (and compiles a grammar) itself: compiled grammars do not
  pickle. It runs the usual EngineLoop (admission window, step log) with outputs sent over the
  pipe instead of scheduled on an event loop.
- A child that dies, or a pipe that closes, is a crash for the service (every live request
  fails, the process exits to be restarted). The child exits when the parent goes away (EOF).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libs.common import telemetry
from libs.common.messages import SamplingOptions
from libs.common.service import freeze_heap
from libs.common.settings import EngineSettings

log = logging.getLogger(__name__)

STATS_PERIOD_S = 0.25


class _Direct:
    """Stands in for an event loop in the child: the loop thread's callbacks run at once."""

    @staticmethod
    def call_soon_threadsafe(fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)


def _core_main(settings_json: str, path: str, conn: Any) -> None:
    """The child: build the engine, step it, serve the parent's commands until stop or EOF."""
    from services.engine.factory import build_engine, to_sampling_params
    from services.engine.loop import EngineLoop

    settings = EngineSettings.model_validate_json(settings_json)
    telemetry.setup_logging(settings.log_level)
    lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

    def crashed(exc: BaseException) -> None:
        send(("crash", f"{type(exc).__name__}: {exc}"))

    try:
        engine = build_engine(settings, Path(path))
    except BaseException as exc:
        log.exception("the engine core could not start")
        crashed(exc)
        return
    loop = EngineLoop.for_service(engine, _Direct(),  # type: ignore[arg-type]
                                  lambda outputs: send(("out", outputs)), crashed, settings)
    executor = getattr(engine, "executor", None)
    if executor is not None:
        executor.on_failure(crashed)
    freeze_heap(settings)
    loop.start()
    send(("ready", {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len}))
    done = threading.Event()

    def push_stats() -> None:
        while not done.wait(STATS_PERIOD_S):
            send(("stats", loop.stats()))

    threading.Thread(target=push_stats, name="core-stats", daemon=True).start()
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "add":
                _, rid, ids, opts_json = msg
                try:
                    params = to_sampling_params(SamplingOptions.model_validate_json(opts_json),
                                                len(ids), engine.max_model_len, engine)
                except ValueError as exc:
                    send(("refused", rid, str(exc)))
                    continue
                loop.add(rid, ids, params)
            elif msg[0] == "abort":
                loop.abort(msg[1])
            else:  # stop
                break
    except (EOFError, OSError):  # the parent is gone
        pass
    finally:
        done.set()
        loop.stop()
        engine.shutdown()


class CoreProcess:
    def __init__(self, settings: EngineSettings, path: Path, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[Any]], None],
                 on_crash: Callable[[BaseException], None],
                 on_refused: Callable[[str, str], None]):
        self.settings, self.path = settings, path
        self._loop = loop
        self._on_outputs, self._on_crash, self._on_refused = on_outputs, on_crash, on_refused
        self._stats: dict[str, Any] = {}
        self._outq: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._stopping = False
        self.vocab_size = 0
        self.max_model_len = 0
        self._conn: Any = None
        self._proc: Any = None

    async def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not a daemon: a tensor-parallel engine starts worker processes of its own
        self._proc = ctx.Process(target=_core_main, name="engine-core", args=(
            self.settings.model_dump_json(), str(self.path), child))
        self._proc.start()
        child.close()
        msg = await asyncio.to_thread(self._first_message)
        if msg[0] != "ready":
            await asyncio.to_thread(self._proc.join, 30)
            raise RuntimeError(f"the engine core did not start: {msg[-1]}")
        self.vocab_size, self.max_model_len = msg[1]["vocab_size"], msg[1]["max_model_len"]
        threading.Thread(target=self._read, name="core-reader", daemon=True).start()
        threading.Thread(target=self._write, name="core-writer", daemon=True).start()
        log.info("engine core process %d ready", self._proc.pid)

    def _first_message(self) -> tuple[Any, ...]:
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                return ("crash", f"the process exited with code {self._proc.exitcode}")
        try:
            return tuple(self._conn.recv())
        except (EOFError, OSError):
            return ("crash", f"the process exited with code {self._proc.exitcode}")

    def _read(self) -> None:
        call = self._loop.call_soon_threadsafe
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    call(self._on_crash, RuntimeError("the engine core process exited"))
                return
            kind = msg[0]
            if kind == "out":
                call(self._on_outputs, msg[1])
            elif kind == "stats":
                self._stats = msg[1]
            elif kind == "refused":
                call(self._on_refused, msg[1], msg[2])
            elif kind == "crash":
                call(self._on_crash, RuntimeError(msg[1]))

    def _write(self) -> None:
        while (msg := self._outq.get()) is not None:
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the child is gone: the reader reports it
                return

    # ------------------------------------------------------------------ EngineLoop's face

    def add(self, request_id: str, prompt_token_ids: list[int], opts: SamplingOptions) -> None:
        self._outq.put(("add", request_id, list(prompt_token_ids), opts.model_dump_json()))

    def abort(self, request_id: str) -> None:
        self._outq.put(("abort", request_id))

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def stop(self) -> None:
        """Stop the child (the engine and its workers with it); blocks up to ~40 s."""
        self._stopping = True
        self._outq.put(("stop",))
        self._outq.put(None)
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10)
