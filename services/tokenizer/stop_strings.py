"""Stop strings over streamed text.

Rules: text before the first occurrence of any stop string is emitted, the stop string and
everything after it never are. Text that could be the start of a stop string (a suffix of what
has arrived that is a prefix of some stop string) is held back until the next piece decides it;
at the end of the stream whatever is held is released, cut at a stop string it holds. A match may
span any number of pieces, and a complete match waits while a longer stop string that would start
earlier is still open (stops "a" and " aa" over " a" + "a" stop before the space).
With `include_stop` (vLLM's `include_stop_str_in_output`) the matched stop string itself is
emitted too, and nothing after it.
"""

from __future__ import annotations

from typing import NamedTuple


def partial_suffix(buf: str, needles: list[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `needles`: text
    that must be held back until the next piece shows whether a needle is starting."""
    best = 0
    for needle in needles:
        for n in range(min(len(needle) - 1, len(buf)), best, -1):
            if buf.endswith(needle[:n]):
                best = n
                break
    return best


class StopResult(NamedTuple):
    text: str          # safe to emit now
    stopped: bool      # a stop string matched; nothing more may be emitted
    matched: str | None = None


class StopStringMatcher:
    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.include_stop = include_stop
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def _cut(self, buf: str, hit: tuple[int, str]) -> str:
        return buf[:hit[0] + (len(hit[1]) if self.include_stop else 0)]

    @property
    def held(self) -> str:
        return self._held

    def push(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        if not self.stops:
            return StopResult(text, False)
        buf = self._held + text
        hit = self._first_hit(buf)
        start = len(buf) - partial_suffix(buf, self.stops)  # earliest open partial match
        if hit is not None and hit[0] <= start:
            self.stopped, self._held, self.matched = True, "", hit[1]
            return StopResult(self._cut(buf, hit), True, hit[1])
        self._held = buf[start:]
        return StopResult(buf[:start], False)

    def _first_hit(self, buf: str) -> tuple[int, str] | None:
        hit: tuple[int, str] | None = None
        for stop in self.stops:
            idx = buf.find(stop)
            if idx >= 0 and (hit is None or idx < hit[0]):
                hit = (idx, stop)
        return hit

    def flush(self) -> str:
        """End of stream: release the held text, up to a stop string it holds (then stopped)."""
        out, self._held = ("" if self.stopped else self._held), ""
        hit = self._first_hit(out)
        if hit is not None:
            self.stopped, self.matched = True, hit[1]
            return self._cut(out, hit)
        return out
