"""The engine loop's heartbeat (what /ready reads to catch a wedged engine): fresh while the
loop idles or steps, stale while one step hangs."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from flotilla.services.engine.loop import EngineLoop


class BlockingEngine:
    """A stand-in Engine (loop.SteppedEngine) with one request whose step() blocks until
    released."""

    last_scheduled = None
    last_phases: tuple[float, ...] = ()

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.release = threading.Event()
        self.in_step = threading.Event()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    priority: int = 0, deadline: float | None = None) -> None:
        self.pending.append(request_id)

    def abort(self, request_id: str) -> None:
        self.pending.remove(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[Any]:
        self.in_step.set()
        self.release.wait(10)
        self.pending = []
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def prepare_thread(self) -> None:
        return None


def _age(loop: EngineLoop) -> float:
    return time.monotonic() - loop.stats()["heartbeat"]


def test_an_idle_loop_keeps_beating_and_a_hung_step_goes_stale() -> None:
    engine = BlockingEngine()
    loop = EngineLoop(engine, asyncio.new_event_loop(), lambda _: None, lambda exc: None)
    loop.start()
    try:
        time.sleep(3 * EngineLoop.idle_beat_s)
        assert _age(loop) < EngineLoop.idle_beat_s + 0.3  # idle, waiting for work, alive
        loop.add("r0", [1], None)
        assert engine.in_step.wait(5)
        time.sleep(3 * EngineLoop.idle_beat_s)
        assert _age(loop) > 2 * EngineLoop.idle_beat_s  # wedged inside step()
        engine.release.set()
        time.sleep(EngineLoop.idle_beat_s)
        assert _age(loop) < EngineLoop.idle_beat_s + 0.3
    finally:
        engine.release.set()
        loop.stop()
