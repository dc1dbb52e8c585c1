"""Payloads larger than the NATS server's `max_payload` (1 MiB by default), sent in parts.

A request with a 1.2 MB prompt must reach the tokenizer (which answers the context-length 400),
and a prompt that fits a long context may be several MiB of token ids: neither may fail with
nats-py's MaxPayloadError. `Bus` uses this module for every request, reply and stream frame;
handlers and readers see whole messages and never know.

Rules:
- A payload up to `part_bytes` (the server's max_payload less room for headers) travels as
  one message, as always.
- Requests and replies (queue-group subjects: consecutive messages may reach different
  members) are *pulled*: the sender keeps the parts and serves them on a fresh inbox
  (`Offer`); its message carries no payload, only the headers `Flotilla-Parts` (count),
  `Flotilla-Size` (bytes) and `Flotilla-Pull` (the inbox). The one receiver pulls part i with
  a request whose payload is `i` (`pull`). An offer closes when its last part was pulled, when
  the sender is done with it (a request's reply arrived), or after `ttl_s`.
- Stream frames (one writer, one reader, one subject, in order) are *pushed*: consecutive
  messages with the header `Flotilla-Part: i/n`; the reader joins them (`Assembler`).
- A receiver refuses to assemble more than `max_bytes` (FlotillaError 413), so a peer cannot
  make it buffer without bound.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from flotilla.libs.common.errors import internal, too_large

log = logging.getLogger(__name__)

PARTS = "Flotilla-Parts"
SIZE = "Flotilla-Size"
PULL = "Flotilla-Pull"
PART = "Flotilla-Part"
HEADER_ROOM = 16 * 1024  # the server counts headers (trace context, ours) against max_payload


def part_size(nc: NATS, override: int | None = None) -> int:
    """The largest payload sent as one message on this connection."""
    if override is not None:
        return override
    return max(1024, nc.max_payload - HEADER_ROOM)


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


class Offer:
    """The parts of one pulled payload, served on an inbox (see the module rules)."""

    def __init__(self, nc: NATS, data: bytes, size: int, ttl_s: float):
        self.nc, self.parts, self.total = nc, split(data, size), len(data)
        self.ttl_s = ttl_s
        self.inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._expiry: asyncio.TimerHandle | None = None

    async def open(self) -> dict[str, str]:
        """Start serving; the headers that announce the payload."""
        self._sub = await self.nc.subscribe(self.inbox, cb=self._serve)
        self._expiry = asyncio.get_running_loop().call_later(
            self.ttl_s, lambda: asyncio.ensure_future(self.close()))
        return {PARTS: str(len(self.parts)), SIZE: str(self.total), PULL: self.inbox}

    async def _serve(self, msg: Msg) -> None:
        try:
            index = int(msg.data)
            part = self.parts[index]
        except (ValueError, IndexError):
            return  # not ours to answer: the puller times out
        if msg.reply:
            await self.nc.publish(msg.reply, part)
        if index == len(self.parts) - 1:
            await self.close()

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # connection closing: the subscription goes with it
                pass


def announced(headers: dict[str, str] | None) -> bool:
    """Whether a message only announces a pulled payload."""
    return headers is not None and PULL in headers


async def pull(nc: NATS, headers: dict[str, str] | None, timeout: float,
               max_bytes: int) -> bytes:
    """The whole payload an `Offer` announced in `headers`."""
    try:
        assert headers is not None
        count, total, inbox = int(headers[PARTS]), int(headers[SIZE]), headers[PULL]
    except (AssertionError, KeyError, ValueError) as exc:
        raise internal(f"a message announced parts with bad headers: {exc!r}") from None
    if total > max_bytes:
        raise too_large(f"The message is {total:,} bytes, over this service's limit of "
                        f"{max_bytes:,}.")
    out = bytearray()
    for index in range(count):
        reply = await nc.request(inbox, str(index).encode(), timeout=timeout)
        out += reply.data
        if len(out) > total:
            break
    if len(out) != total:
        raise internal(f"a message in parts arrived with {len(out)} of {total} bytes")
    return bytes(out)


class Assembler:
    """Joins pushed parts (`Flotilla-Part: i/n`) back into whole stream frames."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, data: bytes, headers: dict[str, str] | None) -> bytes | None:
        """The whole payload when `data` completes one (always, for an unsplit message)."""
        marker = headers.get(PART) if headers else None
        if marker is None:
            return data
        index, _, count = marker.partition("/")
        if int(index) != len(self._parts):
            self._parts, self._size = [], 0
            raise internal(f"stream part {marker} arrived out of order")
        self._size += len(data)
        if self._size > self.max_bytes:
            self._parts, self._size = [], 0
            raise too_large(f"A stream frame is over this service's limit of "
                            f"{self.max_bytes:,} bytes.")
        self._parts.append(data)
        if len(self._parts) < int(count):
            return None
        whole, self._parts, self._size = b"".join(self._parts), [], 0
        return whole


def push_headers(index: int, count: int, base: dict[str, str] | None) -> dict[str, Any]:
    return {**(base or {}), PART: f"{index}/{count}"}
