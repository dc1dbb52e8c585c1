"""A request's deadline: the Unix time after which every hop gives up on it.

`TextRequest.deadline` / `TokenRequest.deadline` carry `at` across the bus; the service that set
it keeps the whole `Deadline` so its own waits stop at `at` and its error can say how long the
request was given.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from flotilla.libs.common.errors import FlotillaError, deadline_exceeded


class Deadline(NamedTuple):
    at: float  # Unix time (seconds)
    timeout_s: float  # what the request was given, for the error message

    @classmethod
    def after(cls, timeout_s: float) -> Deadline:
        return cls(time.time() + timeout_s, timeout_s)

    def remaining(self) -> float:
        """Seconds left; <= 0 once passed."""
        return self.at - time.time()

    def error(self) -> FlotillaError:
        return deadline_exceeded(
            f"The request did not finish within its deadline of {self.timeout_s:g}s "
            "(header X-Request-Timeout, or the server's request_deadline_s).")
