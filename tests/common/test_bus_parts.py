"""Payloads over the NATS server's max_payload travel in parts (libs/common/bus_parts.py), on the
real NATS server: requests and replies in a queue group, stream frames, limits; and stream
readers with a deadline."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from nats.errors import MaxPayloadError

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.deadline import Deadline
from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import (
    Admission,
    RenderReply,
    SamplingOptions,
    TextDelta,
    TextFinal,
    TextFrame,
    TextRequest,
    TokenFrame,
    TokenRequest,
    Usage,
)
from tests.endpoints import NATS_URL


@pytest.fixture
async def bus():
    b = await Bus.connect(NATS_URL, "test-parts")
    yield b
    await b.close()


def _subject() -> str:
    return f"test.parts.{uuid.uuid4().hex}"


def _big_request(chars: int) -> TextRequest:
    # not ASCII-only: multi-byte UTF-8 characters may be split between parts
    text = ("héllo wörld ✓ " * (chars // 14 + 1))[:chars]
    return TextRequest(request_id="big", model="m", kind="completion", prompt=text,
                       stream_subject="s")


async def test_a_request_over_max_payload_reaches_one_queue_member(bus: Bus) -> None:
    """1.2 M characters (> 1 MiB of JSON, the server's max_payload) reach exactly one member of
    a queue group whole, and a reply over max_payload comes back whole."""
    assert bus.nc.max_payload <= 1024 * 1024 + 1  # the default server, as `flotilla up` starts
    subject, seen = _subject(), []
    members = [await Bus.connect(NATS_URL, f"member-{i}") for i in range(3)]

    async def render(req: TextRequest) -> RenderReply:
        seen.append(req.prompt)
        assert isinstance(req.prompt, str)
        return RenderReply(prompt=req.prompt, token_ids=list(range(200_000)))

    try:
        for member in members:
            await member.serve(subject, TextRequest, render, queue="q")
            await member.nc.flush()  # the server knows the subscription before we publish
        request = _big_request(1_200_000)
        with pytest.raises(MaxPayloadError):  # what a plain publish does with it
            await bus.nc.publish(subject, request.model_dump_json().encode())
        reply = await bus.request(subject, request, RenderReply, timeout=5)
        assert seen == [request.prompt]
        assert reply.prompt == request.prompt and reply.token_ids == list(range(200_000))
    finally:
        for member in members:
            await member.close()


async def test_small_parts_round_trip_and_offers_close(bus: Bus) -> None:
    """With a small part size every hop splits; nothing stays subscribed afterwards."""
    small = await Bus.connect(NATS_URL, "small-parts", part_bytes=1000)
    subject = _subject()

    async def echo(req: TokenRequest) -> Admission:
        return Admission(request_id=req.request_id * 300, accepted=True,
                         prompt_tokens=sum(req.prompt_token_ids))

    try:
        await small.serve(subject, TokenRequest, echo, queue="q")
        ids = list(range(5000))
        reply = await small.request(subject, TokenRequest(
            request_id="r", model="m", prompt_token_ids=ids, sampling=SamplingOptions(),
            stream_subject="x"), Admission, timeout=5)
        assert reply.prompt_tokens == sum(ids) and reply.request_id == "r" * 300
        await asyncio.sleep(0.05)
        offers = [sub.subject for sub in small.nc._subs.values()
                  if sub.subject.startswith("_INBOX.") and not sub.subject.endswith("*")]
        assert offers == []  # both offers closed once pulled (the request's and the reply's)
    finally:
        await small.close()


async def test_stream_frames_over_the_part_size_arrive_whole_and_in_order() -> None:
    writer_bus = await Bus.connect(NATS_URL, "w", part_bytes=700)
    reader_bus = await Bus.connect(NATS_URL, "r", part_bytes=700)
    subject = _subject()
    try:
        reader = await reader_bus.open_reader(subject, TextFrame, timeout=2)
        # the writer is on another connection: the server must have the subscription first
        # (services send the request that starts a stream after it, on the same connection)
        await reader_bus.nc.flush()
        writer = writer_bus.writer(subject, "r", TextFrame, heartbeat_interval=0.01)
        texts = [("é" * 3000) + str(i) if i % 2 else f"small {i}" for i in range(6)]
        for text in texts:
            await writer.data(TextDelta(text=text))
            await asyncio.sleep(0.02)  # heartbeats in between, never inside a split frame
        await writer.final(TextFinal(finish_reason="stop",
                                     usage=Usage(prompt_tokens=1, completion_tokens=6)))
        frames = [f async for f in reader]
        await reader.close()
        assert [f.data.text for f in frames[:-1]] == texts
        assert frames[-1].kind == "final"
    finally:
        await writer_bus.close()
        await reader_bus.close()


async def test_a_receiver_assembles_at_most_its_limit() -> None:
    small = await Bus.connect(NATS_URL, "limit", part_bytes=1000)
    small.max_message_bytes = 5000
    subject = _subject()
    try:
        reader = await small.open_reader(subject, TextFrame, timeout=2)
        writer = small.writer(subject, "r", TextFrame, heartbeat_interval=1)
        await writer.data(TextDelta(text="x" * 6000))
        with pytest.raises(FlotillaError) as err:
            await reader.next()
        assert err.value.status == 413
        await reader.close()
    finally:
        await small.close()


async def test_reader_deadline_ends_a_live_stream(bus: Bus) -> None:
    """Frames keep coming (heartbeats), yet the read ends at the deadline with a 504."""
    subject = _subject()
    deadline = Deadline.after(0.4)
    reader = await bus.open_reader(subject, TokenFrame, timeout=2, deadline=deadline)
    writer = bus.writer(subject, "r", TokenFrame, heartbeat_interval=0.05)
    started = time.monotonic()
    with pytest.raises(FlotillaError) as err:
        await reader.next()
    elapsed = time.monotonic() - started
    writer.close()
    await reader.close()
    assert err.value.status == 504 and err.value.info.code == "deadline_exceeded"
    assert 0.3 < elapsed < 0.8, elapsed


async def test_silence_before_the_deadline_is_still_a_503(bus: Bus) -> None:
    subject = _subject()
    reader = await bus.open_reader(subject, TokenFrame, timeout=0.2,
                                   deadline=Deadline.after(30))
    with pytest.raises(FlotillaError) as err:
        await reader.next()
    await reader.close()
    assert err.value.status == 503
