"""Worker lanes (services/tokenizer/lanes.py): bounded, never a hang, and the wait for a thread is
told apart from the work itself — a full lane or a long wait is a 503 with Retry-After, a
deadline that passes while waiting is a 504, and a job nobody waits for any more does not run."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from flotilla.libs.common.errors import FlotillaError
from flotilla.services.tokenizer.lanes import Lane


async def test_a_full_lane_refuses_at_once_with_retry_after() -> None:
    lane = Lane("test", workers=1, max_queue=1, max_wait_s=5.0)
    release = threading.Event()
    running = asyncio.ensure_future(lane.run(lambda: release.wait(5)))
    queued = asyncio.ensure_future(lane.run(lambda: "queued"))
    await asyncio.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(FlotillaError) as err:
        await lane.run(lambda: "refused")
    assert time.monotonic() - start < 0.1
    assert err.value.status == 503 and (err.value.info.retry_after_s or 0) >= 1
    release.set()
    assert await running is True and await queued == "queued"
    assert lane.taken == 0
    lane.shutdown()


async def test_a_job_that_waited_too_long_or_past_its_deadline_does_not_run() -> None:
    lane = Lane("test", workers=1, max_queue=4, max_wait_s=0.2)
    ran: list[str] = []
    release = threading.Event()
    busy = asyncio.ensure_future(lane.run(lambda: release.wait(5)))
    await asyncio.sleep(0.05)
    late = asyncio.ensure_future(lane.run(lambda: ran.append("late")))
    expired = asyncio.ensure_future(lane.run(lambda: ran.append("expired"),
                                             deadline=time.time() + 0.1))
    await asyncio.sleep(0.4)
    release.set()
    await busy
    for job, status in ((late, 503), (expired, 503)):  # the wait limit passed for both
        with pytest.raises(FlotillaError) as err:
            await job
        assert err.value.status == status
    lane2 = Lane("test2", workers=1, max_queue=4, max_wait_s=5.0)
    release2 = threading.Event()
    busy2 = asyncio.ensure_future(lane2.run(lambda: release2.wait(5)))
    await asyncio.sleep(0.05)
    deadline = asyncio.ensure_future(lane2.run(lambda: ran.append("deadline"),
                                               deadline=time.time() + 0.1))
    await asyncio.sleep(0.3)
    release2.set()
    await busy2
    with pytest.raises(FlotillaError) as err:
        await deadline
    assert err.value.status == 504 and err.value.info.code == "deadline_exceeded"
    assert ran == []
    lane.shutdown()
    lane2.shutdown()


async def test_a_timeout_answers_503_and_keeps_the_slot_until_the_job_ends() -> None:
    lane = Lane("test", workers=1, max_queue=0, max_wait_s=0.1)
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(FlotillaError) as err:
        await lane.run(lambda: release.wait(5), timeout_s=0.2)
    assert err.value.status == 503 and time.monotonic() - start < 1.0
    assert lane.taken == 1  # the thread still runs it: the lane refuses more meanwhile
    with pytest.raises(FlotillaError):
        await lane.run(lambda: None)
    release.set()
    for _ in range(50):
        if lane.taken == 0:
            break
        await asyncio.sleep(0.02)
    assert lane.taken == 0 and await lane.run(lambda: 7) == 7
    lane.shutdown()


async def test_budgets_do_not_count_the_wait_for_a_thread() -> None:
    """A job that waited 0.3 s for the only thread still gets its whole 0.25 s limit."""
    lane = Lane("test", workers=1, max_queue=1, max_wait_s=1.0)
    first = asyncio.ensure_future(lane.run(lambda: time.sleep(0.3)))
    await asyncio.sleep(0.02)
    assert await lane.run(lambda: time.sleep(0.2) or "done", timeout_s=0.25) == "done"
    await first
    lane.shutdown()
