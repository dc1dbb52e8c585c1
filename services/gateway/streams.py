"""The NATS side of one HTTP request: one text stream per choice, merged into one sequence.

Rules:
- Each choice's reader is open before its `tokenizer_generate` request is sent, so no frame is
  missed. `start()` returns only when every choice was admitted; otherwise it cancels the choices
  that were admitted, closes every reader and raises the first refusal (an HTTP error, sent
  before any response byte).
- `events()` yields `(choice, frame)` for data and final frames of all choices as they arrive,
  and ends after the last final. A failure of any choice (error frame, dead upstream) cancels
  every unfinished choice and raises FlotillaError. Several choices are merged through one pump
  task per reader; a single choice (the common case) is read directly, one task wake-up less
  per frame.
- `deadline` (optional): admission waits and every stream read stop when it passes; the
  request then fails with 504 `deadline_exceeded` and every unfinished choice is cancelled
  (reason `deadline`), whatever the tokenizer and engine do on their side.
- `timer` (optional) sees the admission round trip and every data and final frame of each
  choice (the gateway's metrics: services/gateway/metrics.py).
- The request's API-key meter (key_usage.py), if any, hears each choice's admission (its
  prompt tokens) and final usage, for the key's tokens-per-minute count.
- Cancels are published from tasks of their own (`Bus.spawn`), so they go out even while the
  caller is being cancelled (client disconnect). `close()` may be called any number of times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, NamedTuple, NoReturn

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus, StreamReader
from flotilla.libs.common.deadline import Deadline
from flotilla.libs.common.errors import FlotillaError, internal
from flotilla.libs.common.messages import (
    Admission,
    Cancel,
    TextDelta,
    TextFinal,
    TextFrame,
    TextRequest,
)
from flotilla.services.gateway.key_usage import CURRENT as KEY_USAGE
from flotilla.services.gateway.metrics import ChoiceTimer

log = logging.getLogger(__name__)


class ChoiceEvent(NamedTuple):
    choice: int  # the choice's index in the response
    frame: TextFrame


async def _outcome(work: Awaitable[None]) -> BaseException | None:
    """`work`'s exception as a value, as gather(return_exceptions=True) gives it (a
    cancellation of the awaiting task still propagates)."""
    try:
        await work
    except Exception as exc:
        return exc
    return None


class ChoiceStreams:
    def __init__(self, bus: Bus, requests: list[TextRequest], admission_timeout_s: float,
                 stream_timeout_s: float, deadline: Deadline | None = None,
                 timer: ChoiceTimer | None = None):
        self.bus, self.requests = bus, requests
        self.timer = timer
        self.admission_timeout_s, self.stream_timeout_s = admission_timeout_s, stream_timeout_s
        self.deadline = deadline
        self._readers: dict[int, StreamReader[TextDelta, TextFinal]] = {}
        self._unfinished: set[int] = set()
        self._pumps: list[asyncio.Task[Any]] = []
        self._closed = False
        self._prompt_tokens: dict[int, int] = {}
        self.key_usage = KEY_USAGE.get()  # the API key's meter (key_usage.py), if any

    @property
    def unfinished(self) -> list[str]:
        return [self.requests[i].request_id for i in sorted(self._unfinished)]

    async def _admit(self, index: int) -> None:
        req = self.requests[index]
        self._readers[index] = await self.bus.open_reader(req.stream_subject, TextFrame,
                                                          timeout=self.stream_timeout_s,
                                                          deadline=self.deadline)
        self._unfinished.add(index)  # from here on the tokenizer may hold it: cancel on failure
        timeout, by_deadline = self.admission_timeout_s, False
        if self.deadline is not None:
            left = self.deadline.remaining()
            if left <= 0:
                raise self.deadline.error()
            timeout, by_deadline = min(timeout, left), left < timeout
        sent = time.monotonic()
        try:
            reply = await self.bus.request(subjects.tokenizer_generate(req.model), req,
                                           Admission, timeout=timeout)
        except FlotillaError as exc:
            if (by_deadline and self.deadline is not None and exc.status == 503
                    and self.deadline.remaining() < 0.05):  # timed out, not refused at once
                raise self.deadline.error() from None
            raise
        if not reply.accepted:
            self._unfinished.discard(index)
            raise FlotillaError(reply.error) if reply.error else internal(
                f"the tokenizer refused {req.request_id} without a reason")
        self._prompt_tokens[index] = reply.prompt_tokens
        if self.key_usage is not None:
            self.key_usage.choice_admitted(reply.prompt_tokens)
        if self.timer is not None:
            self.timer.admitted(sent)

    async def start(self) -> None:
        try:
            if len(self.requests) == 1:  # one choice: admitted in this task, no task hop (in a
                results = [await _outcome(self._admit(0))]  # burst each waits for every other)
            else:
                results = await asyncio.gather(
                    *(self._admit(i) for i in range(len(self.requests))), return_exceptions=True)
        except BaseException:  # cancelled while admitting (the client went away)
            self.cancel("client_disconnect")
            self.close()
            raise
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            self.cancel("client_disconnect")
            self.close()
            first = failures[0]
            if isinstance(first, FlotillaError):
                raise first
            raise internal(f"admission failed: {first!r}") from first

    async def _pump(self, index: int, queue: asyncio.Queue[tuple[int, Any]]) -> None:
        try:
            async for frame in self._readers[index]:
                await queue.put((index, frame))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        if len(self._readers) == 1:  # one choice: read it here, without a pump task and queue
            (index, reader), = self._readers.items()
            while self._unfinished:
                try:
                    frame = await reader.next()
                except Exception as exc:
                    self._fail(index, exc)
                if frame.kind == "final":
                    self._finished(index, frame)
                self._time(index, frame)
                yield ChoiceEvent(index, frame)
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._pumps = [asyncio.ensure_future(self._pump(i, queue)) for i in self._readers]
        while self._unfinished:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                self._fail(index, item)
            if item.kind == "final":
                self._finished(index, item)
            self._time(index, item)
            yield ChoiceEvent(index, item)

    def _finished(self, index: int, frame: TextFrame) -> None:
        self._unfinished.discard(index)
        if self.key_usage is not None and frame.final is not None:
            self.key_usage.choice_finished(frame.final.usage, self._prompt_tokens.get(index, 0))

    def _time(self, index: int, frame: TextFrame) -> None:
        if self.timer is None:
            return
        if frame.kind == "data":
            self.timer.data(index)
        elif frame.kind == "final" and frame.final is not None:
            self.timer.final(frame.final)

    def _fail(self, index: int, exc: BaseException) -> NoReturn:
        """Choice `index` failed: cancel every unfinished choice (the failed one too: a silent
        upstream may still hold it, and its KV blocks) and raise FlotillaError."""
        late = isinstance(exc, FlotillaError) and exc.info.code == "deadline_exceeded"
        self.cancel("deadline" if late else "client_disconnect")
        if isinstance(exc, FlotillaError):
            raise exc
        raise internal(f"stream of choice {index} failed: {exc!r}") from exc

    def cancel(self, reason: str = "client_disconnect") -> None:
        """Publish Cancel for every choice not finished yet (each once)."""
        ids = self.unfinished
        self._unfinished.clear()
        for request_id in ids:
            self.bus.spawn(self._publish_cancel(request_id, reason))

    async def _publish_cancel(self, request_id: str, reason: str) -> None:
        try:
            await self.bus.publish(subjects.CANCEL, Cancel(request_id=request_id,
                                                           reason=reason))  # type: ignore[arg-type]
        except Exception as exc:  # connection closing: the engine's own timeouts take over
            log.warning("cannot publish cancel for %s: %s", request_id, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._pumps:
            task.cancel()
        for reader in self._readers.values():
            self.bus.spawn(reader.close())
