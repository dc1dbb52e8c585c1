"""Requests' deadlines, soonest first, so the engine checks them every step for the price of
one comparison.

Rules:
- `add` records a request's deadline (Unix time); `due(now)` pops every entry whose deadline
  has passed. Entries of requests that finished meanwhile are left in the heap and dropped when
  they come up: the caller checks that the request is still live.
- `deadline_error` is the error a request gets when its deadline passes: 504, code
  "deadline_exceeded", saying how long it ran and where (queued or generating).
"""

from __future__ import annotations

import heapq
import itertools

from flotilla.services.engine.request import Request
from flotilla.services.engine.request_error import RequestError


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._order = itertools.count()

    def add(self, request_id: str, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), request_id))

    def next(self) -> float | None:
        """The soonest deadline (possibly of a request already finished), or None."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> list[str]:
        """Ids whose deadline is at or before `now` (removed from the heap)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def __len__(self) -> int:
        return len(self._heap)


def deadline_error(request: Request, now: float) -> RequestError:
    ran = now - request.arrival_time
    if request.first_scheduled_time is None:
        where = "all of it waiting in the queue"
    else:
        waited = request.first_scheduled_time - request.arrival_time
        where = (f"{waited:.2f} s of it waiting in the queue, "
                 f"{request.num_output_tokens} tokens generated")
    return RequestError(f"the request passed its deadline after {ran:.2f} s in the engine "
                        f"({where})", status=504, type="timeout_error", code="deadline_exceeded")
