"""EngineLoop admission: a burst of requests reaching an idle engine shares its first step (a
quiet window that slides with each arrival, capped from the first)."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from flotilla.services.engine.loop import EngineLoop


class StepRecorder:
    """A stand-in Engine (loop.SteppedEngine): each step() finishes every request added so far
    and records which."""

    last_scheduled: Any = None
    last_phases: tuple[float, ...] = ()

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.steps: list[list[str]] = []
        self.stepped = threading.Event()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    priority: int = 0, deadline: float | None = None) -> None:
        self.pending.append(request_id)

    def abort(self, request_id: str) -> None:
        self.pending.remove(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[Any]:
        self.steps.append(self.pending)
        self.pending = []
        self.stepped.set()
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def prepare_thread(self) -> None:
        return None


def _run_burst(window_s: float, gap_s: float) -> list[list[str]]:
    """One request wakes the idle loop, four more follow `gap_s` later; the steps taken."""
    engine = StepRecorder()
    loop = EngineLoop(engine, asyncio.new_event_loop(), lambda _: None,
                      lambda exc: None, admit_window_s=window_s)
    loop.start()
    try:
        loop.add("r0", [1], None)
        time.sleep(gap_s)
        for i in range(1, 5):
            loop.add(f"r{i}", [1], None)
        deadline = time.monotonic() + 5
        while sum(map(len, engine.steps)) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    return engine.steps


def test_burst_within_the_admission_window_shares_the_first_step() -> None:
    steps = _run_burst(window_s=0.5, gap_s=0.05)
    assert steps == [["r0", "r1", "r2", "r3", "r4"]]


def test_without_a_window_the_first_request_does_not_wait() -> None:
    steps = _run_burst(window_s=0.0, gap_s=0.2)
    assert steps[0] == ["r0"]
    assert sum(steps, []) == ["r0", "r1", "r2", "r3", "r4"]


def _run_arrivals(window_s: float, cap_s: float, times: list[float]) -> list[list[str]]:
    """Requests r0, r1, ... added at `times` (s after the first) to an idle loop; the steps."""
    engine = StepRecorder()
    loop = EngineLoop(engine, asyncio.new_event_loop(), lambda _: None, lambda exc: None,
                      admit_window_s=window_s, admit_window_max_s=cap_s)
    loop.start()
    try:
        t0 = time.monotonic()
        for i, t in enumerate(times):
            time.sleep(max(0.0, t0 + t - time.monotonic()))
            loop.add(f"r{i}", [1], None)
        deadline = time.monotonic() + 5
        while sum(map(len, engine.steps)) < len(times) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    return engine.steps


def test_a_burst_longer_than_the_window_shares_the_first_step_while_it_keeps_coming() -> None:
    """Arrivals 0.2 s apart with a 0.4 s quiet window: the window slides, one step for all
    (a fixed window would have stepped at 0.4 s with three)."""
    steps = _run_arrivals(0.4, 5.0, [0.0, 0.2, 0.4, 0.6, 0.8])
    assert steps[0] == ["r0", "r1", "r2", "r3", "r4"]


def test_the_wait_is_capped_from_the_first_arrival() -> None:
    """The window keeps sliding, but the cap (0.7 s after r0) starts the step; later arrivals
    take the next one."""
    steps = _run_arrivals(0.4, 0.7, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert steps[0] == ["r0", "r1", "r2", "r3"]
    assert sum(steps, []) == [f"r{i}" for i in range(6)]


def test_a_lone_request_waits_the_window_not_the_cap() -> None:
    engine = StepRecorder()
    loop = EngineLoop(engine, asyncio.new_event_loop(), lambda _: None, lambda exc: None,
                      admit_window_s=0.05, admit_window_max_s=30.0)
    loop.start()
    try:
        t = time.monotonic()
        loop.add("r0", [1], None)
        assert engine.stepped.wait(5)
        assert time.monotonic() - t < 2.0
    finally:
        loop.stop()


def test_commands_queued_before_a_step_are_all_admitted() -> None:
    engine = StepRecorder()
    loop = EngineLoop(engine, asyncio.new_event_loop(), lambda _: None, lambda exc: None)
    for i in range(8):  # queued before the thread runs: one drain, one step
        loop.add(f"r{i}", [1], None)
    loop.start()
    try:
        assert engine.stepped.wait(5)
    finally:
        loop.stop()
    assert engine.steps[0] == [f"r{i}" for i in range(8)]


def test_stop_during_the_window_ends_the_thread() -> None:
    engine = StepRecorder()
    loop = EngineLoop(engine, asyncio.new_event_loop(), lambda _: None, lambda exc: None,
                      admit_window_s=30.0)
    loop.start()
    loop.add("r0", [1], None)
    t = time.monotonic()
    loop.stop()
    assert time.monotonic() - t < 5
    assert not loop._thread.is_alive()


def test_per_thread_warm_up_runs_on_the_loop_thread_before_the_first_step() -> None:
    """Caches PyTorch keeps per thread (cuDNN attention plans) are warmed by the thread that
    steps the engine: the engine's prepare_thread (Engine: the runner's dense-attention warm-up)
    runs on the engine-loop thread, before any step."""
    seen: list[tuple[str, int]] = []

    class Engine(StepRecorder):
        def prepare_thread(self) -> None:
            seen.append((threading.current_thread().name, len(self.steps)))

    engine = Engine()
    loop = EngineLoop(engine, asyncio.new_event_loop(), lambda _: None, lambda exc: None)
    loop.start()
    try:
        loop.add("r0", [1], None)
        assert engine.stepped.wait(5)
    finally:
        loop.stop()
    assert seen == [("engine-loop", 0)]


def test_step_log_has_a_line_per_step(tmp_path: Any) -> None:
    @dataclass
    class Out:
        request_id: str
        new_token_ids: list[int]
        num_output_tokens: int

    @dataclass
    class Plan:
        requests: list[Any]
        num_batched_tokens: int

    @dataclass
    class Sched:
        is_prefill: bool

    class Engine(StepRecorder):
        def step(self) -> list[Any]:
            ids = self.pending
            gc.collect()  # a pause the log must show
            super().step()
            self.last_scheduled = Plan([Sched(True) for _ in ids], 16 * len(ids))
            return [Out(i, [7], 1) for i in ids]

    path = tmp_path / "steps.jsonl"
    engine = Engine()
    loop = EngineLoop(engine, asyncio.new_event_loop(), lambda _: None, lambda exc: None,
                      admit_window_s=0.05, step_log=str(path))
    loop.start()
    try:
        loop.add("a", [1], None)
        loop.add("b", [1], None)
        assert engine.stepped.wait(5)
    finally:
        loop.stop()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 1
    row = lines[0]
    assert (row["added"], row["tokens"], row["seqs"], row["prefills"], row["outputs"],
            row["first_tokens"]) == (2, 32, 2, 2, 2, 2)
    assert row["step_ms"] >= 0 and abs(row["t"] - time.time()) < 60
    assert row["gc_ms"] > 0 and len(row["arrivals"]) == 2


class Refuser(StepRecorder):
    """Refuses request "bad" when it is added, as an Engine raises on a bad request."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    priority: int = 0, deadline: float | None = None) -> None:
        if request_id == "bad":
            raise ValueError("logit_bias: token id 99999 is outside the vocabulary")
        super().add_request(request_id, prompt_token_ids, params, priority, deadline)


def test_a_request_the_engine_refuses_comes_back_as_an_error_and_the_loop_goes_on() -> None:
    engine = Refuser()
    outputs: list[Any] = []
    crashes: list[BaseException] = []
    aio = asyncio.new_event_loop()
    loop = EngineLoop(engine, aio, outputs.extend, crashes.append)
    loop.start()
    try:
        loop.add("bad", [1], None)
        loop.add("good", [1], None)
        assert engine.stepped.wait(5)
        aio.run_until_complete(asyncio.sleep(0.05))  # runs the callbacks the thread scheduled
    finally:
        loop.stop()
        aio.close()
    assert engine.steps == [["good"]] and not crashes
    (out,) = outputs
    assert out.request_id == "bad" and out.finish_reason == "error"
    assert out.error.status == 400 and "logit_bias" in out.error.message


def test_queue_state_counts_arrivals_at_once_and_hands_them_to_the_engine_count() -> None:
    """Admission reads queue_state: requests given to `add` count before the loop thread
    takes them (a burst between two steps is seen whole); once the engine has them, its own
    stats (here: nothing waiting, the stand-in runs everything at once) take over."""
    engine = StepRecorder()
    loop = EngineLoop(engine, asyncio.new_event_loop(), lambda _: None, lambda exc: None)
    for i in range(3):
        loop.add(f"r{i}", [1] * (10 + i), None)
    state = loop.queue_state()
    assert (state.waiting, state.waiting_tokens) == (3, 33)
    loop.start()
    try:
        assert engine.stepped.wait(5)
        deadline = time.monotonic() + 5
        while loop.queue_state().waiting and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    state = loop.queue_state()
    assert (state.waiting, state.waiting_tokens) == (0, 0)
