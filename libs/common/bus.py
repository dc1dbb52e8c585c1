"""The message bus: typed request/reply, broadcast, and per-request streams over nats-py.

Rules:
- Every payload is a pydantic model from `libs.common.messages`; this module only encodes/decodes.
- Handlers run in their own tasks, so a slow request never blocks the subscription behind it.
- Trace context rides in NATS headers on every request and publish, and is re-attached around
  each handler, so spans in the receiving service join the sender's trace.
- Streams (bus_streams.py): a `StreamWriter` numbers every frame and sends a heartbeat when
  idle; a `StreamReader` checks the numbering, turns an `error` frame into `FlotillaError`, and
  declares the peer dead when nothing (not even a heartbeat) arrives within the timeout. The
  reader subscribes before the request that starts the stream is sent, so no frame is missed.
- A reader may have a `Deadline`: a read that would wait past it raises its 504
  (`deadline_exceeded`), even while frames keep coming.
- A reader's subscription callback appends each message to the reader's deque and wakes the
  reader if it waits; the timeout is one timer per wait. (nats-py's `next_msg(timeout)` costs a
  new task, two before Python 3.12, and a uuid per message: a large share of a streamed
  token's CPU in the gateway and the tokenizer.)
- A request whose handler raises (or whose reply cannot be encoded) is answered at once with
  the error (a `FlotillaError`'s own, else a 500) in the `Flotilla-Error` header; `request`
  raises it. The requester never waits out its timeout for a handler that failed.
- Payloads larger than the server's max_payload travel in parts (bus_parts.py: requests and
  replies pulled by their one receiver, stream frames pushed in order); handlers and readers
  see whole messages. A receiver assembles at most `max_message_bytes`.
- Requests and replies reach the socket as soon as they are published (`write_now`). nats-py
  queues every publish and writes from a flusher task, which runs after every task that is
  already ready: in a burst of 64 requests each service forwarded the first one only after it
  had taken in all of them, so each hop delivered the burst late and all at once. Stream frames
  keep nats-py's batching (many frames per write).
- Losing the NATS connection ends every open stream reader at once with a 503 (after the
  frames it already has): the server drops our subscriptions until we reconnect, so the
  stream cannot continue, and the client should not wait out the heartbeat timeout for that.
  nats-py reconnects on its own (every 0.5 s, forever) and restores the subscriptions; the
  loss, the first failed attempt (not each one) and the reconnection are logged once each.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import BaseModel

from flotilla.libs.common import telemetry
from flotilla.libs.common.bus_parts import Offer, announced, part_size, pull
from flotilla.libs.common.bus_streams import StreamReader, StreamWriter
from flotilla.libs.common.deadline import Deadline
from flotilla.libs.common.errors import FlotillaError, internal, unavailable
from flotilla.libs.common.messages import ErrorInfo, StreamFrame, decode, encode
from flotilla.libs.common.nats_auth import NatsSecurity

log = logging.getLogger(__name__)

# a request whose handler failed is answered with an empty payload and its ErrorInfo (JSON) here
ERROR_HEADER = "Flotilla-Error"

Req = TypeVar("Req", bound=BaseModel)
Rep = TypeVar("Rep", bound=BaseModel)
D = TypeVar("D", bound=BaseModel)
F = TypeVar("F", bound=BaseModel)


_WRITE_NOW: contextvars.ContextVar[bool] = contextvars.ContextVar("flotilla_write_now",
                                                                 default=False)


class _Client(NATS):
    """nats-py's client; a publish made while `_WRITE_NOW` is set (by `Bus.request` and by a
    handler's reply) writes the outbound buffer to the socket before returning, instead of
    leaving it to the flusher task. The buffer is written whole, so order is kept."""

    write_now = True

    async def _send_publish(self, *args: Any, **kwargs: Any) -> None:
        await super()._send_publish(*args, **kwargs)
        if self.write_now and _WRITE_NOW.get():
            try:
                self.write_pending()
            except AttributeError:  # nats-py's internals moved: its flusher writes everything
                log.warning("nats-py has no outbound buffer where expected; requests are "
                            "written by its flusher task from now on")
                self.write_now = False

    def write_pending(self) -> None:
        transport = self._transport
        if self._pending and transport is not None and self.is_connected:
            transport.writelines(self._pending)
            self._pending = []
            self._pending_data_size = 0


class NoResponders(FlotillaError):
    """A request found nobody subscribed to its subject (503)."""


class NoReply(FlotillaError):
    """A request got no reply within its timeout (503)."""


class Bus:
    """A NATS connection with typed helpers. One per service process."""

    max_message_bytes = 64 * 1024 * 1024  # the most one message in parts may assemble to
    part_timeout_s = 5.0  # how long a handler's reply in parts waits to be pulled

    def __init__(self, nc: NATS, part_bytes: int | None = None):
        """`part_bytes`: split payloads above this (default: the server's max_payload less
        room for headers; tests set it small)."""
        self.nc = nc
        self._part_bytes = part_bytes
        self._tasks: set[asyncio.Task[Any]] = set()
        self._readers: weakref.WeakSet[StreamReader[Any, Any]] = weakref.WeakSet()
        self._last_error = ""

    @property
    def part_bytes(self) -> int:
        return part_size(self.nc, self._part_bytes)

    @classmethod
    async def connect(cls, url: str, name: str, write_now: bool = True,
                      part_bytes: int | None = None,
                      security: NatsSecurity | None = None) -> Bus:
        """`write_now`: requests and replies go to the socket when published (see the module
        notes); False leaves every write to nats-py's flusher. `security`: credentials and TLS
        (nats_auth.py; None = an open connection)."""
        nc = _Client()
        nc.write_now = write_now
        bus = cls(nc, part_bytes)
        await nc.connect(
            servers=[u.strip() for u in url.split(",")],
            name=name,
            connect_timeout=2,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]
            error_cb=bus._on_error,
            disconnected_cb=bus._on_disconnected,
            reconnected_cb=bus._on_reconnected,
            **(security.connect_options() if security else {}),
        )
        return bus

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    async def _on_error(self, exc: Exception) -> None:
        # every reconnect attempt fails the same way while the server is away: say it once
        text = str(exc) or type(exc).__name__
        if text != self._last_error:
            self._last_error = text
            log.warning("nats: %s", text)
        else:
            log.debug("nats: %s", text)

    async def _on_disconnected(self) -> None:
        if self.nc.is_closed:  # our own close()
            return
        error = unavailable("the connection to the message bus (NATS) was lost; the stream "
                            "cannot continue")
        ended = sum(reader.fail(error) for reader in list(self._readers))
        log.warning("lost the NATS connection; reconnecting (%d open streams end now)", ended)

    async def _on_reconnected(self) -> None:
        self._last_error = ""
        log.warning("NATS connection restored (%s)", self.nc.connected_url.netloc
                    if self.nc.connected_url else "")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.nc.is_connected:
            try:
                await self.nc.drain()
            except Exception:  # already closing: nothing left to flush
                await self.nc.close()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run a coroutine as a tracked task (kept alive until done, cancelled on close)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def publish(self, subject: str, msg: BaseModel) -> None:
        await self.nc.publish(subject, encode(msg), headers=telemetry.inject_headers() or None)

    async def request(self, subject: str, msg: BaseModel, reply_cls: type[Rep],
                      timeout: float) -> Rep:
        """Request/reply. No responder or no reply in time → FlotillaError 503."""
        data = encode(msg)
        headers = telemetry.inject_headers() or None
        offer = None
        if len(data) > self.part_bytes:
            offer = Offer(self.nc, data, self.part_bytes, ttl_s=timeout)
            headers, data = {**(headers or {}), **await offer.open()}, b""
        now = _WRITE_NOW.set(True)
        try:
            reply = await self.nc.request(subject, data, timeout=timeout, headers=headers)
            payload = reply.data
            if reply.headers and ERROR_HEADER in reply.headers:
                raise FlotillaError(ErrorInfo.model_validate_json(reply.headers[ERROR_HEADER]))
            if announced(reply.headers):
                payload = await pull(self.nc, reply.headers, timeout, self.max_message_bytes)
        except NoRespondersError as exc:
            raise NoResponders(unavailable(
                f"no service is serving {subject.split('.', 2)[-1]}").info) from exc
        except (TimeoutError, NatsTimeoutError) as exc:
            raise NoReply(unavailable(
                f"no reply on {subject} within {timeout:.1f}s").info) from exc
        finally:
            _WRITE_NOW.reset(now)
            if offer is not None:
                await offer.close()
        return decode(payload, reply_cls)

    async def serve(self, subject: str, req_cls: type[Req],
                    handler: Callable[[Req], Awaitable[BaseModel | None]],
                    queue: str | None = None) -> Subscription:
        """Answer requests on `subject` (load-balanced over `queue`), one task per request."""

        async def run(m: Msg) -> None:
            data = m.data
            if announced(m.headers):
                try:
                    data = await pull(self.nc, m.headers, self.part_timeout_s,
                                      self.max_message_bytes)
                except Exception as exc:  # the requester's own timeout answers it
                    log.warning("a request on %s in parts could not be assembled: %s",
                                subject, exc)
                    return
            token = telemetry.attach(telemetry.extract_context(m.headers))
            try:
                reply = await handler(decode(data, req_cls))
                payload = encode(reply) if reply is not None and m.reply else b""
            except Exception as exc:  # the requester gets the error now, not a timeout
                if not isinstance(exc, FlotillaError):
                    log.exception("handler for %s failed", subject)
                if m.reply:
                    await self._reply_error(m.reply, exc, subject)
                return
            finally:
                telemetry.detach(token)
            if payload:
                await self._reply(m.reply, payload)

        async def cb(m: Msg) -> None:
            self.spawn(run(m))

        return await self.nc.subscribe(subject, queue=queue or "", cb=cb)

    async def _reply_error(self, inbox: str, exc: Exception, subject: str) -> None:
        info = exc.info if isinstance(exc, FlotillaError) else internal(
            f"the service failed handling {subject.split('.', 2)[-1]}: "
            f"{type(exc).__name__}").info
        # ASCII JSON: header values take no newlines, and lone surrogates stay escaped
        await self._reply(inbox, b"", {ERROR_HEADER: json.dumps(info.model_dump())})

    async def _reply(self, inbox: str, data: bytes,
                     headers: dict[str, str] | None = None) -> None:
        if len(data) > self.part_bytes:  # pulled by the requester; the offer closes itself
            offer = Offer(self.nc, data, self.part_bytes, ttl_s=self.part_timeout_s)
            headers, data = await offer.open(), b""
        now = _WRITE_NOW.set(True)
        try:
            await self.nc.publish(inbox, data, headers=headers)
        finally:
            _WRITE_NOW.reset(now)

    async def subscribe(self, subject: str, msg_cls: type[Req],
                        handler: Callable[[Req], Awaitable[None]]) -> Subscription:
        """Receive broadcasts (every subscriber gets each message)."""
        return await self.serve(subject, msg_cls, handler)

    @staticmethod
    async def unsubscribe_all(subs: list[Subscription]) -> None:
        """Drop subscriptions at shutdown; one whose connection is already gone is fine."""
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closed
                pass
        subs.clear()

    async def open_reader(self, subject: str, frame_cls: type[StreamFrame[D, F]],
                          timeout: float, deadline: Deadline | None = None) -> StreamReader[D, F]:
        reader: StreamReader[D, F] = StreamReader(frame_cls, timeout, deadline,
                                                  max_bytes=self.max_message_bytes)
        reader.sub = await self.nc.subscribe(subject, cb=reader.deliver)
        self._readers.add(reader)
        return reader

    def writer(self, subject: str, request_id: str, frame_cls: type[StreamFrame[D, F]],
               heartbeat_interval: float) -> StreamWriter[D, F]:
        return StreamWriter(self, subject, request_id, frame_cls, heartbeat_interval)


