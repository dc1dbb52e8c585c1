"""One request's stream over the bus: `StreamWriter` (the producer's side) and `StreamReader`
(the consumer's), made by `Bus.writer` and `Bus.open_reader` (bus.py, whose rules they follow:
numbered frames, heartbeats when idle, error frames raised as FlotillaError, silence past the
timeout or the reader's deadline as an error, frames over the server's max_payload pushed in
parts and joined here)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel

from flotilla.libs.common.bus_parts import Assembler, push_headers, split
from flotilla.libs.common.deadline import Deadline
from flotilla.libs.common.errors import FlotillaError, internal, unavailable
from flotilla.libs.common.messages import ErrorInfo, StreamFrame, decode, encode

if TYPE_CHECKING:
    from flotilla.libs.common.bus import Bus

D = TypeVar("D", bound=BaseModel)
F = TypeVar("F", bound=BaseModel)


class StreamWriter(Generic[D, F]):
    """Sends one request's frames in order; heartbeats keep the reader patient while idle."""

    def __init__(
        self,
        bus: Bus,
        subject: str,
        request_id: str,
        frame_cls: type[StreamFrame[D, F]],
        heartbeat_interval: float,
    ):
        self.bus, self.subject, self.request_id = bus, subject, request_id
        self.frame_cls = frame_cls
        self.interval = heartbeat_interval
        self._seq = 0
        self._last = time.monotonic()
        self._lock = asyncio.Lock()
        self._closed = False
        self._heartbeat = bus.spawn(self._beat())

    @property
    def closed(self) -> bool:
        return self._closed

    async def _send(
        self, kind: Literal["data", "final", "error", "heartbeat"], **fields: Any
    ) -> None:
        async with self._lock:
            if self._closed:
                return
            frame = self.frame_cls(request_id=self.request_id, seq=self._seq, kind=kind, **fields)
            self._seq += 1
            self._last = time.monotonic()
            if kind in ("final", "error"):
                self._closed = True
                self._heartbeat.cancel()
            data = encode(frame)
            if len(data) <= self.bus.part_bytes:
                await self.bus.nc.publish(self.subject, data)
                return
            parts = split(data, self.bus.part_bytes)  # pushed in order; the reader joins them
            for index, part in enumerate(parts):
                await self.bus.nc.publish(
                    self.subject, part, headers=push_headers(index, len(parts), None)
                )

    async def _beat(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.interval)
            if not self._closed and time.monotonic() - self._last >= self.interval * 0.9:
                try:
                    await self._send("heartbeat")
                except Exception:  # connection closing: the reader's timeout takes over
                    return

    async def data(self, payload: D) -> None:
        await self._send("data", data=payload)

    async def final(self, payload: F) -> None:
        await self._send("final", final=payload)

    async def error(self, info: ErrorInfo) -> None:
        await self._send("error", error=info)

    def close(self) -> None:
        """Stop heartbeats without a final frame (the request was cancelled by the reader)."""
        self._closed = True
        self._heartbeat.cancel()


class StreamReader(Generic[D, F]):
    """Iterates the data and final frames of one stream; raises FlotillaError on an error frame,
    a gap in the numbering, or silence longer than the timeout. `deliver` is its subscription's
    callback (`Bus.open_reader` wires it)."""

    sub: Subscription | None = None

    def __init__(
        self,
        frame_cls: type[StreamFrame[D, F]],
        timeout: float,
        deadline: Deadline | None = None,
        max_bytes: int = 64 * 1024 * 1024,
    ):
        self.frame_cls, self.timeout, self.deadline = frame_cls, timeout, deadline
        self._expected = 0
        self._done = False
        self._inbox: deque[bytes | FlotillaError] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._assembler = Assembler(max_bytes)
        self._failure: FlotillaError | None = None

    async def deliver(self, msg: Msg) -> None:
        item: bytes | FlotillaError | None = msg.data
        if msg.headers:
            try:
                item = self._assembler.add(msg.data, msg.headers)
            except FlotillaError as exc:
                item = exc  # raised by the reader, in order
        if item is None:
            return  # a part of a frame still arriving
        self._inbox.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: FlotillaError) -> bool:
        """End the stream with `error` once the frames already received are read (the bus
        lost its connection: nothing more can arrive). False if it had already ended."""
        if self._done or self._failure is not None:
            return False
        self._failure = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        return True

    async def _receive(self) -> bytes:
        wait, by_deadline = self.timeout, False
        if self.deadline is not None:
            left = self.deadline.remaining()
            if left <= 0:
                raise self.deadline.error()
            wait, by_deadline = min(wait, left), left < wait
        if not self._inbox:
            if self._failure is not None:
                raise self._failure
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(wait, _expire, waiter)
            try:
                await waiter
            except TimeoutError as exc:
                if by_deadline and self.deadline is not None:
                    raise self.deadline.error() from None
                raise unavailable(
                    f"the upstream service stopped responding (no frame for {self.timeout:.1f}s)"
                ) from exc
            finally:
                timer.cancel()
                self._waiter = None
        item = self._inbox.popleft()
        if isinstance(item, FlotillaError):
            raise item
        return item

    async def next(self) -> StreamFrame[D, F]:
        while True:
            frame = decode(await self._receive(), self.frame_cls)
            if frame.seq != self._expected:
                raise internal(
                    f"stream {frame.request_id}: frame {self._expected} was lost (got {frame.seq})"
                )
            self._expected += 1
            if frame.kind == "heartbeat":
                continue
            if frame.kind == "error":
                self._done = True
                assert frame.error is not None
                raise FlotillaError(frame.error)
            if frame.kind == "final":
                self._done = True
            return frame

    async def __aiter__(self) -> AsyncIterator[StreamFrame[D, F]]:
        while not self._done:
            yield await self.next()

    async def close(self) -> None:
        if self.sub is None:
            return
        try:
            await self.sub.unsubscribe()
        except Exception:  # connection already closed
            pass


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
