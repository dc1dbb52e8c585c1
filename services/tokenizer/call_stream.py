"""What every streaming tool-call parser shares: text goes in piece by piece (`push`), content
and call deltas come out (`Parsed`), and `flush` ends the reply.

Rules:
- Content that is only whitespace at the reply's start or right after a call is held: a reply
  that turns out to be only calls sends none of it; any other text takes the held whitespace
  with it (`_emit`). At the end, held whitespace is content only when no call was made.
- Subclasses scan `_buf` in `_step(final)` until it returns False (more text is needed, or the
  buffer is used up); `final` says no more text will come. `_until(marker, final)` emits the
  content before a marker and reports where the marker starts, holding back a partial one.
"""

from __future__ import annotations

import uuid
from typing import NamedTuple

from flotilla.libs.common.messages import ToolCallDelta
from flotilla.services.tokenizer.stop_strings import partial_suffix


class Parsed(NamedTuple):
    content: str = ""
    calls: list[ToolCallDelta] = []


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallStream:
    """The shared state and output side (see the module rules)."""

    def __init__(self) -> None:
        self.calls = 0  # calls emitted
        self._any_call = False  # a call was committed (emitted or dropped)
        self._buf = ""
        self._fresh = True  # nothing but whitespace since the reply's start or the last call
        self._ws = ""  # whitespace held while fresh
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def push(self, text: str) -> Parsed:
        self._buf += text
        self._run(final=False)
        return self._take()

    def flush(self) -> Parsed:
        self._run(final=True)
        if self._ws and not self._any_call:
            self._content.append(self._ws)
        self._ws = ""
        return self._take()

    def _run(self, final: bool) -> None:
        while self._buf and self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _take(self) -> Parsed:
        out = Parsed("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return out

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self._fresh:
            if text.isspace():
                self._ws += text
                return
            text, self._ws, self._fresh = self._ws + text, "", False
        self._content.append(text)

    def _until(self, marker: str, final: bool) -> int:
        """Emit the content before `marker` and drop it from the buffer: 0 when the buffer now
        starts with the marker, -1 when it holds none (a partial marker at its end is kept
        unless `final`)."""
        at = self._buf.find(marker)
        if at < 0:
            keep = 0 if final else partial_suffix(self._buf, [marker])
            self._emit(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return -1
        self._emit(self._buf[:at])
        self._buf = self._buf[at:]
        return 0
