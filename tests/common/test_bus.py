"""The bus against the real NATS server on loopback: typed request/reply, streams, liveness."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import (
    Admission,
    ErrorInfo,
    SamplingOptions,
    TokenDelta,
    TokenFinal,
    TokenFrame,
    TokenRequest,
)
from tests.endpoints import NATS_URL


@pytest.fixture
async def bus():
    b = await Bus.connect(NATS_URL, "test")
    yield b
    await b.close()


def _subject() -> str:
    return f"test.{uuid.uuid4().hex}"


async def test_request_reply_typed(bus: Bus) -> None:
    subject = _subject()

    async def handler(req: TokenRequest) -> Admission:
        return Admission(request_id=req.request_id, accepted=True,
                         prompt_tokens=len(req.prompt_token_ids))

    await bus.serve(subject, TokenRequest, handler, queue="q")
    req = TokenRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3],
                       sampling=SamplingOptions(), stream_subject="x")
    reply = await bus.request(subject, req, Admission, timeout=2)
    assert reply.accepted and reply.prompt_tokens == 3


async def test_a_failing_handler_answers_with_its_error_at_once(bus: Bus) -> None:
    """A handler that raises, a reply that cannot be encoded (a lone surrogate) and a request
    that cannot be decoded all answer the requester now, never after its timeout."""
    from flotilla.libs.common.errors import invalid_request

    subjects = [_subject() for _ in range(3)]

    async def refuses(req: TokenRequest) -> Admission:
        raise invalid_request("no such thing", param="x")

    async def unencodable(req: TokenRequest) -> ErrorInfo:
        return ErrorInfo(message="\udc64")

    await bus.serve(subjects[0], TokenRequest, refuses)
    await bus.serve(subjects[1], TokenRequest, unencodable)
    await bus.serve(subjects[2], TokenRequest, refuses)
    req = TokenRequest(request_id="r", model="m", prompt_token_ids=[1],
                       sampling=SamplingOptions(), stream_subject="x")
    loop = asyncio.get_running_loop()
    for subject, status in zip(subjects[:2], (400, 500), strict=True):
        t0 = loop.time()
        with pytest.raises(FlotillaError) as err:
            await bus.request(subject, req, Admission, timeout=5)
        assert err.value.status == status and loop.time() - t0 < 1
    assert err.value.info.type == "server_error"
    t0 = loop.time()
    with pytest.raises(FlotillaError) as err:  # NaN: not a TokenRequest
        reply = await bus.nc.request(subjects[2], b'{"request_id": NaN}', timeout=5)
        await bus.request(subjects[2], req, Admission, timeout=5)
    assert err.value.status == 400 and loop.time() - t0 < 1
    assert reply.headers and "Flotilla-Error" in reply.headers


async def test_no_responders_is_503(bus: Bus) -> None:
    req = TokenRequest(request_id="r", model="m", prompt_token_ids=[1],
                       sampling=SamplingOptions(), stream_subject="x")
    with pytest.raises(FlotillaError) as err:
        await bus.request(_subject(), req, Admission, timeout=2)
    assert err.value.status == 503


async def test_stream_in_order_with_final(bus: Bus) -> None:
    subject = _subject()
    reader = await bus.open_reader(subject, TokenFrame, timeout=2)
    writer = bus.writer(subject, "r", TokenFrame, heartbeat_interval=0.05)
    for i in range(50):
        await writer.data(TokenDelta(token_ids=[i]))
    await writer.final(TokenFinal(finish_reason="length", prompt_tokens=1, completion_tokens=50))
    got = [f async for f in reader]
    await reader.close()
    assert [f.data.token_ids[0] for f in got[:-1]] == list(range(50))
    assert got[-1].final.completion_tokens == 50


async def test_heartbeats_keep_slow_stream_alive(bus: Bus) -> None:
    subject = _subject()
    reader = await bus.open_reader(subject, TokenFrame, timeout=0.3)
    writer = bus.writer(subject, "r", TokenFrame, heartbeat_interval=0.05)
    await asyncio.sleep(1.0)  # a "long prefill": only heartbeats for 1 s, > 3x the timeout
    await writer.final(TokenFinal(finish_reason="stop", prompt_tokens=1, completion_tokens=0))
    frames = [f async for f in reader]
    assert frames[-1].kind == "final"


async def test_silent_peer_is_detected(bus: Bus) -> None:
    subject = _subject()
    reader = await bus.open_reader(subject, TokenFrame, timeout=0.3)
    writer = bus.writer(subject, "r", TokenFrame, heartbeat_interval=0.05)
    await writer.data(TokenDelta(token_ids=[1]))
    writer.close()  # the peer dies: no more frames, no heartbeats
    assert (await reader.next()).data.token_ids == [1]
    with pytest.raises(FlotillaError) as err:
        await reader.next()
    assert err.value.status == 503


async def test_error_frame_raises(bus: Bus) -> None:
    subject = _subject()
    reader = await bus.open_reader(subject, TokenFrame, timeout=2)
    writer = bus.writer(subject, "r", TokenFrame, heartbeat_interval=1)
    await writer.error(ErrorInfo(status=400, type="invalid_request_error", message="bad"))
    with pytest.raises(FlotillaError) as err:
        await reader.next()
    assert err.value.status == 400 and err.value.info.message == "bad"


async def test_gap_is_detected(bus: Bus) -> None:
    subject = _subject()
    reader = await bus.open_reader(subject, TokenFrame, timeout=2)
    frame = TokenFrame(request_id="r", seq=1, kind="data", data=TokenDelta(token_ids=[1]))
    await bus.nc.publish(subject, frame.model_dump_json().encode())
    with pytest.raises(FlotillaError, match="lost"):
        await reader.next()


@pytest.mark.parametrize("write_now", [True, False])
async def test_a_request_reaches_the_socket_before_other_ready_tasks_run(write_now: bool) -> None:
    """With write_now, a request's PUB is written as it is published, not when nats-py's
    flusher task gets its turn (after every task already ready; in a burst, after the whole
    burst was taken in). Stream frames (plain publishes) keep the flusher's batching."""
    b = await Bus.connect(NATS_URL, "test-write-now", write_now=write_now)
    try:
        transport = b.nc._transport
        assert transport is not None
        written: list[bytes] = []
        write = transport.writelines

        def spy(data: list[bytes]) -> None:
            written.append(b"".join(data))
            write(data)

        transport.writelines = spy  # type: ignore[method-assign]
        subject = _subject()
        req = TokenRequest(request_id="r", model="m", prompt_token_ids=[1],
                           sampling=SamplingOptions(), stream_subject="x")
        pending = asyncio.ensure_future(b.request(subject, req, Admission, timeout=1))
        await asyncio.sleep(0)  # the request runs up to its wait for the reply; we run next
        sent = any(subject.encode() in chunk for chunk in written)
        assert sent is write_now
        frame = TokenFrame(request_id="r", seq=0, kind="data", data=TokenDelta(token_ids=[1]))
        await b.publish(subject + ".frames", frame)
        assert not any(b".frames" in chunk for chunk in written)  # batched: the flusher's
        with pytest.raises(FlotillaError):  # no responders
            await pending
        assert any(b".frames" in chunk for chunk in written)
    finally:
        await b.close()


async def test_write_now_falls_back_to_the_flusher_if_nats_internals_move() -> None:
    """A nats-py without the outbound buffer this relies on still delivers everything."""
    b = await Bus.connect(NATS_URL, "test-write-now-fallback")
    try:
        subject = _subject()

        async def handler(req: TokenRequest) -> Admission:
            return Admission(request_id=req.request_id, accepted=True)

        await b.serve(subject, TokenRequest, handler)

        def moved() -> None:
            raise AttributeError("_pending")

        b.nc.write_pending = moved  # type: ignore[attr-defined]
        req = TokenRequest(request_id="r", model="m", prompt_token_ids=[1],
                           sampling=SamplingOptions(), stream_subject="x")
        reply = await b.request(subject, req, Admission, timeout=2)
        assert reply.accepted
        assert b.nc.write_now is False  # type: ignore[attr-defined]
    finally:
        await b.close()


async def test_losing_the_nats_connection_ends_open_streams_at_once_and_reconnects() -> None:
    """A NATS server that dies drops our subscriptions: the stream cannot continue, so the
    reader ends with a 503 right away (not after its 30 s timeout), frames already received
    first; the bus reconnects to a server brought back on the same port."""
    from flotilla.services.launcher.nats_server import NatsServer

    server = NatsServer().start()
    port = server.port
    try:
        b = await Bus.connect(server.url, "test-disconnect")
        subject = _subject()
        reader = await b.open_reader(subject, TokenFrame, timeout=30)
        writer = b.writer(subject, "r", TokenFrame, heartbeat_interval=10)
        await writer.data(TokenDelta(token_ids=[7]))
        await b.nc.flush()
        await asyncio.sleep(0.1)
        assert server.proc is not None
        server.proc.kill()
        started = asyncio.get_running_loop().time()
        assert (await reader.next()).data.token_ids == [7]
        with pytest.raises(FlotillaError) as err:
            await reader.next()
        assert err.value.status == 503 and "connection to the message bus" in str(err.value)
        assert asyncio.get_running_loop().time() - started < 2.0
        assert not b.connected
        server.stop()
        server = NatsServer(port=port).start()
        for _ in range(100):
            if b.connected:
                break
            await asyncio.sleep(0.05)
        assert b.connected
        writer.close()
        await b.close()
    finally:
        server.stop()
