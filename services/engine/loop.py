"""Runs the Engine's step loop on its own thread, next to the asyncio service.

Rules:
- Only the loop thread touches the Engine. The asyncio side submits commands (add, abort)
  through a thread-safe queue and receives each step's outputs through `on_outputs`, called on
  the event loop with `call_soon_threadsafe`.
- When there is no work the thread blocks on the command queue, so an idle engine burns no CPU.
- Before each step the thread applies every command already queued. When a request wakes an
  idle engine, the thread first waits for more while they keep coming: until `admit_window_s`
  passes without a new command, at most `admit_window_max_s` after the first. A burst of
  arrivals reaching the engine over tens of ms (64 streams through HTTP and two NATS hops: 17-82
  ms on an H100 host) then shares one or two prefill steps instead of ~10 partial ones, each of
  which re-reads every weight; a lone request waits `admit_window_s`. A busy engine never waits:
  what arrived during a step joins the next one.
- A crash inside `step()` fails every request in flight (through `on_crash`) rather than
  leaving them hanging.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: Any


@dataclass
class _Abort:
    request_id: str


class EngineLoop:
    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[Any]], None],
                 on_crash: Callable[[BaseException], None], admit_window_s: float = 0.0,
                 admit_window_max_s: float | None = None):
        self.engine = engine
        self.admit_window_s = admit_window_s
        self.admit_window_max_s = max(admit_window_s, admit_window_max_s or admit_window_s)
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_crash = on_crash
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stats: dict[str, Any] = {}
        self._stats_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    def add(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self._commands.put(_Add(request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step (a copy; safe from any thread)."""
        with self._stats_lock:
            return dict(self._stats)

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Add):
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
        else:
            self.engine.abort(cmd.request_id)

    def _refresh_stats(self) -> None:
        stats = self.engine.stats()
        with self._stats_lock:
            self._stats = stats

    def _admit(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one when `block`; when that one woke an idle
        engine, then for more until the admission window passes quietly or its cap is reached);
        False once stop was requested."""
        deadline: float | None = None
        cap = 0.0
        waking = block and self.admit_window_s > 0
        while True:
            timeout = None if deadline is None else deadline - time.monotonic()
            try:
                if block and timeout is None:
                    cmd = self._commands.get()
                elif timeout is not None and timeout > 0:
                    cmd = self._commands.get(timeout=timeout)
                else:
                    cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if cmd is None:
                return False
            self._apply(cmd)
            if waking:  # a quiet window after each arrival, within the cap from the first
                now = time.monotonic()
                if deadline is None:
                    cap = now + self.admit_window_max_s
                deadline = min(now + self.admit_window_s, cap)
            block = False

    def _run(self) -> None:
        self._refresh_stats()
        try:
            # per-thread caches (cuDNN attention plans, FLOTILLA_DENSE_PREFILL) belong to the
            # thread that steps the engine, not to the one that built it
            warm = getattr(getattr(self.engine, "runner", None), "warm_up_dense_attention", None)
            if warm is not None:
                warm()
            while True:
                if not self._admit(block=not self.engine.has_unfinished()):
                    return
                if not self.engine.has_unfinished():
                    self._refresh_stats()
                    continue
                outputs = self.engine.step()
                self._refresh_stats()
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)
        except BaseException as exc:  # the engine is broken: fail everything, don't hang
            log.exception("engine loop crashed")
            self._loop.call_soon_threadsafe(self._on_crash, exc)
