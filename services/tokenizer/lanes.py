"""Bounded lanes of worker threads for the tokenizer's blocking work (templates, tokenization,
grammar checks), so that one kind of request cannot take the threads every other kind needs.

Rules:
- A lane has a fixed number of worker threads and room for a fixed number of waiting jobs. A job
  offered to a full lane is refused at once: 503 with `retry_after_s` (the lane's recent mean
  job time times the jobs ahead, per worker, at least 1 s). Nothing queues without bound.
- A job that waited longer than `max_wait_s` before a worker took it is not run (503, with the
  same estimate); one whose request deadline passed meanwhile is not run either (504
  `deadline_exceeded`); nor one whose caller stopped waiting (cancelled).
- The wait in the queue is never charged to a job's own budget: budgets (the chat template's,
  the grammar check's) start when a worker starts the job.
- `run(..., timeout_s=)` stops waiting once the job has had at least `timeout_s` of its own
  (after `max_wait_s + timeout_s` in all): 503. The worker finishes the job anyway (Python
  threads cannot be stopped) and its slot stays taken until then, so a lane of slow jobs
  refuses new ones instead of piling them up.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from flotilla.libs.common.errors import deadline_exceeded, unavailable

T = TypeVar("T")

_EWMA = 0.2  # weight of the newest job time in the lane's mean


class Lane:
    """One pool of `workers` threads with `max_queue` waiting places (see module rules)."""

    def __init__(self, name: str, workers: int, max_queue: int, max_wait_s: float):
        self.name, self.workers, self.max_queue, self.max_wait_s = (
            name, workers, max_queue, max_wait_s)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"tokenizer-{name}")
        self._lock = threading.Lock()
        self._taken = 0  # jobs queued or running (a running job holds its slot until it ends)
        self._mean_s = 0.01

    @property
    def taken(self) -> int:
        return self._taken

    def retry_after_s(self) -> float:
        """Seconds until a job offered now would likely start (at least 1)."""
        ahead = max(self._taken - self.workers + 1, 1)
        return float(max(1, round(self._mean_s * ahead / self.workers + 0.5)))

    def _busy(self, why: str) -> Exception:
        return unavailable(f"the tokenizer is busy ({self.name} work {why}); retry later",
                           retry_after_s=self.retry_after_s())

    async def run(self, fn: Callable[[], T], deadline: float | None = None,
                  timeout_s: float | None = None) -> T:
        """`fn()` on a worker thread, under the lane's rules. `deadline`: Unix time."""
        with self._lock:
            if self._taken >= self.workers + self.max_queue:
                raise self._busy("queue is full")
            self._taken += 1
        offered = time.monotonic()

        def job() -> tuple[T, float]:
            started = time.monotonic()
            if started - offered > self.max_wait_s:
                raise self._busy(f"waited over {self.max_wait_s:g}s")
            if deadline is not None and time.time() > deadline:
                raise deadline_exceeded("the request's deadline passed while it waited for the "
                                        "tokenizer")
            return fn(), started

        future: Future[tuple[T, float]] = self._pool.submit(job)
        future.add_done_callback(self._release)
        limit = None if timeout_s is None else self.max_wait_s + timeout_s
        try:
            value, started = await asyncio.wait_for(asyncio.wrap_future(future), limit)
        except TimeoutError:
            raise self._busy(f"took longer than its {timeout_s:g}s limit") from None
        took = time.monotonic() - started
        self._mean_s += _EWMA * (took - self._mean_s)
        return value

    def _release(self, _: Future[tuple[T, float]]) -> None:
        with self._lock:
            self._taken -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
