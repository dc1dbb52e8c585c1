"""The gateway's per-request and per-event pieces, each timed alone (bench/gateway_overhead.py
prints them as its first table): body validation, parse, plan, the `gateway.request` span with a
recording tracer (what it costs once an exporter is set), frame decode, chunk building, SSE
encoding, and reading a stream. Where this tree replaced a piece, the replaced way is timed
beside it ("before")."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from typing import Any

from bench.gateway_overhead import CHAT, COMPLETION, FakeNC, Progress, run


def cpu_us(fn: Callable[[], Any], n: int, repeat: int = 3) -> float:
    """CPU microseconds per call of `fn` (best of `repeat` loops of `n`)."""
    for _ in range(min(n, 50)):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def pieces(tokens: int) -> list[tuple[str, float | None, float]]:
    """(what, before µs or None when unchanged, now µs)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from flotilla.libs.common.messages import TextDelta, TextFrame, decode, encode
    from flotilla.services.gateway.chunks import chunk_builder
    from flotilla.services.gateway.plan import chat_plan
    from flotilla.services.gateway.spec import Spec
    from flotilla.services.gateway.sse import sse
    from flotilla.services.gateway.tracing import TracingMiddleware

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    spec, reference = Spec.load(), Spec.load(compiled=False)
    chat, completion = json.loads(json.dumps(CHAT)), json.loads(json.dumps(COMPLETION))
    raw = json.dumps(chat).encode()
    rows: list[tuple[str, float | None, float]] = []
    for op, body in (("createChatCompletion", chat), ("createCompletion", completion)):
        rows.append((f"validate {op}", cpu_us(functools.partial(reference.validate, op, body), 300),
                     cpu_us(functools.partial(spec.validate, op, body), 3000)))
    rows.append(("parse body (json.loads)", None, cpu_us(lambda: json.loads(raw), 5000)))
    rows.append(("chat_plan + encode TextRequest", None,
                 cpu_us(lambda: encode(chat_plan(chat, None, 8).requests[0]), 2000)))

    async def noop_app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def nothing(_: Any) -> None:
        pass

    async def receive_nothing() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    middleware = TracingMiddleware(noop_app)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "scheme": "http",
             "http_version": "1.1", "headers": [(b"host", b"x"), (b"user-agent", b"bench")]}

    async def spans(n: int) -> float:
        t0 = time.process_time()
        for _ in range(n):
            await middleware(scope, receive_nothing, nothing)
        return (time.process_time() - t0) / n * 1e6

    run(spans(200))
    rows.append(("gateway.request span, recording", None, min(run(spans(2000))
                                                             for _ in range(3))))

    frame = encode(TextFrame(request_id="bench-0", seq=0, kind="data",
                             data=TextDelta(text=" dragon")))
    rows.append(("decode TextFrame", None, cpu_us(lambda: decode(frame, TextFrame), 20000)))
    plan = chat_plan(chat, None, 8)
    chunks = chunk_builder(plan, int(time.time()))
    delta = TextDelta(text=" dragon")
    rows.append(("chunk build (ChatChunks.delta)", None,
                 cpu_us(lambda: chunks.delta(0, delta), 20000)))
    chunk = chunks.delta(0, delta)
    assert chunk is not None and json.loads(sse(chunk)[6:]) == chunk
    rows.append(("SSE encode", cpu_us(
        lambda: b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n", 20000),
        cpu_us(lambda: sse(chunk), 20000)))
    rows.append(("stream read + decode, per frame", run(_read_cost(False, tokens)),
                 run(_read_cost(True, tokens))))
    return rows


async def _read_cost(callback: bool, frames: int, rounds: int = 30) -> float:
    """CPU µs per frame to hand `frames` frames, one at a time, to a waiting reader that decodes
    them: nats-py's next_msg(timeout) (before) or this tree's StreamReader (callback)."""
    from nats.aio.msg import Msg

    from flotilla.libs.common.bus import StreamReader
    from flotilla.libs.common.messages import TextDelta, TextFrame, decode, encode

    nc = FakeNC([], Progress(), 0)
    data = [encode(TextFrame(request_id="r", seq=i, kind="data", data=TextDelta(text="x")))
            for i in range(frames)]
    async def consume(receive: Callable[[], Any], got: Progress) -> None:
        for _ in range(frames):
            await receive()
            got.bump()

    total = 0.0
    for _ in range(rounds):
        got = Progress()
        if callback:
            reader: StreamReader[Any, Any] = StreamReader(TextFrame, 3.0)
            sub = await nc.subscribe("s.stream.x", cb=reader.deliver)
            receive: Callable[[], Any] = reader.next
        else:
            sub = await nc.subscribe("s.stream.x")

            async def receive(sub: Any = sub) -> Any:
                return decode((await sub.next_msg(timeout=3.0)).data, TextFrame)
        t0 = time.process_time()
        task = asyncio.ensure_future(consume(receive, got))
        for i, d in enumerate(data):
            sub._pending_size += len(d)
            sub._pending_queue.put_nowait(Msg(nc, subject="s", data=d))  # type: ignore[arg-type]
            await got.past(i)
        await task
        total += time.process_time() - t0
        await sub.unsubscribe()
    return total / (rounds * frames) * 1e6
