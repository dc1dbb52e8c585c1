"""The scheduler's queue of requests not running: by priority, then first come, first served.

Rules:
- Order is (priority, arrival): lower priority values first (vLLM's convention), and within a
  level the order requests reached the scheduler (`Request.arrival`, set once by `push` of a new
  request). A preempted request keeps its arrival, so it goes back ahead of every later arrival
  of its level, as it was before it was admitted.
- `num_tokens` is the tokens the queued requests still have to compute (prompt, plus generated
  tokens of preempted requests): the queue's share of the engine's pending prefill work.
- Kept as a sorted list: a queue is bounded by the engine's admission limits (hundreds), and
  the scheduler reads its head every step.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from flotilla.services.engine.request import Request


def _key(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival)


class WaitingQueue:
    def __init__(self) -> None:
        self._queue: list[Request] = []
        self._arrivals = itertools.count(1)
        self._tokens: dict[str, int] = {}  # what each queued request added to num_tokens
        self.num_tokens = 0

    def push(self, request: Request, new: bool = False) -> None:
        """Queue a request: a new one (its arrival is set now) or one preempted."""
        if new:
            request.arrival = next(self._arrivals)
        bisect.insort_right(self._queue, request, key=_key)
        self._tokens[request.request_id] = request.num_tokens
        self.num_tokens += request.num_tokens

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        request = self._queue.pop(0)
        self.num_tokens -= self._tokens.pop(request.request_id)
        return request

    def remove(self, request: Request) -> None:
        self._queue.remove(request)
        self.num_tokens -= self._tokens.pop(request.request_id)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]
