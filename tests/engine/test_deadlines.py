"""Per-request deadlines in the engine: a request past its deadline, waiting or running, is
finished with a 504 error saying how long it ran, its KV blocks freed; the others go on."""

from __future__ import annotations

import time
from typing import Any

from flotilla.services.engine.engine import RequestOutput
from flotilla.services.engine.sampling_params import SamplingParams
from tests.engine.test_engine import make_engine, tiny  # noqa: F401 - the fixture

LONG = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)


def _step_until(engine: Any, when: float, outs: dict[str, list[RequestOutput]]) -> None:
    while time.time() < when + 0.05 and engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        time.sleep(0.01)


def test_a_waiting_request_past_its_deadline_fails_with_504(tiny: Any) -> None:  # noqa: F811
    path, _ = tiny
    engine = make_engine(path, max_num_seqs=1)  # "late" can only wait behind "busy"
    engine.add_request("busy", [3, 4, 5], LONG)
    deadline = time.time() + 0.3
    engine.add_request("late", [6, 7, 8], LONG, deadline=deadline)
    outs: dict[str, list[RequestOutput]] = {}
    _step_until(engine, deadline, outs)
    last = outs["late"][-1]
    assert last.finish_reason == "error" and last.error is not None
    assert last.error.status == 504 and last.error.code == "deadline_exceeded"
    assert "all of it waiting in the queue" in last.error.message
    assert not last.new_token_ids and "late" not in engine.scheduler.requests
    assert outs["busy"][-1].finish_reason is None  # still generating, undisturbed


def test_a_running_request_past_its_deadline_is_aborted_and_its_blocks_freed(
        tiny: Any) -> None:  # noqa: F811
    path, _ = tiny
    engine = make_engine(path)
    deadline = time.time() + 0.3
    many = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    engine.add_request("late", [6, 7, 8], many, deadline=deadline)
    engine.add_request("free", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3))
    engine.add_request("slow", [3, 4, 5, 9], LONG)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished() and "late" not in {o.request_id for v in outs.values()
                                                     for o in v if o.finished}:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        time.sleep(0.01)
    generated = [t for o in outs["late"] for t in o.new_token_ids]
    last = outs["late"][-1]
    assert time.time() >= deadline and last.error is not None and last.error.status == 504
    assert f"{len(generated)} tokens generated" in last.error.message
    assert len(generated) < 100  # it was stopped mid-stream
    slow = engine.scheduler.requests["slow"]
    assert engine.kv.pool.num_used_blocks == len(slow.block_ids) + (
        len(engine.scheduler.requests["free"].block_ids) if "free" in engine.scheduler.requests
        else 0)  # "late" holds none
    while "free" in engine.scheduler.requests:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["free"][-1].finish_reason == "length"
    assert [t for o in outs["free"] for t in o.new_token_ids] == _alone(path)


def _alone(path: Any) -> list[int]:
    engine = make_engine(path)
    engine.add_request("free", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3))
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out
