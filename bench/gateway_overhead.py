"""The gateway's CPU cost per streamed request and per streamed token event, on CPU, in-process.

    python bench/gateway_overhead.py [--requests 200] [--tokens 64] [--baseline PATH]

Three tables:

- pieces (bench/gateway_pieces.py): the work of one request (body parse, schema validation,
  plan, a recording `gateway.request` span) and of one token event (frame decode, stream read,
  chunk building, SSE encoding), each timed in a loop. Where this tree replaced a piece, the
  replaced way is timed beside it ("before": pure-Python jsonschema for validation, json.dumps
  for SSE, nats-py's `next_msg(timeout)` for reading a stream).
- whole requests: streaming /v1/chat/completions and /v1/completions driven through the real ASGI
  app, `Bus` and nats-py `Subscription` objects, with only the NATS connection faked (replies
  and frames come from memory, one frame after the previous event was written). HTTP parsing
  (uvicorn/httptools) is not included. CPU per request with 1 and with --tokens tokens gives
  the cost per request and per event. `--baseline PATH` runs the same measurement on another
  checkout (e.g. `git archive HEAD | tar -x -C /tmp/base`) in a subprocess, for a before column.
- a burst: 64 /v1/completions started together through the same app; when the first, the
  median and the last reach the bus (a request that reaches it late reaches the tokenizer and
  the engine late).

Needs no GPU, NATS or network; runs in well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
MODEL = "bench-model"
CHAT = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 256, "temperature": 0.0,
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Tell me a long story about a dragon. " * 8}]}
COMPLETION = {"model": MODEL, "prompt": "hello " * 128, "max_tokens": 64, "temperature": 0.0,
              "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


# ------------------------------------------------------------------ a NATS connection in memory


class Progress:
    """Counts response body messages; lets the frame feeder wait for the next one."""

    def __init__(self) -> None:
        self.count = 0
        self._waiter: asyncio.Future[None] | None = None

    def bump(self) -> None:
        self.count += 1
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def past(self, n: int) -> None:
        while self.count <= n:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter


class FakeNC:
    """The part of nats-py's Client that Bus uses, without a server: requests are answered from
    memory and each stream subscription is fed `frames`, one after the previous SSE event (after
    the `opening` events a response sends before any frame: chat's role chunk)."""

    is_closed = is_draining = is_reconnecting = False
    is_connected = True

    def __init__(self, frames: list[bytes], progress: Progress, opening: int):
        from flotilla.libs.common.messages import Admission, ToolsListReply, encode

        self.frames, self.progress, self.opening = frames, progress, opening
        self.admitted = encode(Admission(request_id="bench", accepted=True))
        self.no_tools = encode(ToolsListReply(tools=[]))
        self._sid = 0
        self._stream: Any = None
        self._feeders: set[asyncio.Task[None]] = set()

    async def subscribe(self, subject: str, queue: str = "", cb: Any = None, **_: Any) -> Any:
        from nats.aio.subscription import Subscription

        self._sid += 1
        sub = Subscription(self, self._sid, subject, queue, cb)
        sub._start(None)
        if ".stream." in subject:
            self._stream = sub
        return sub

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 1.0,
                      headers: Any = None, **_: Any) -> Any:
        from nats.aio.msg import Msg

        if subject.endswith(".generate"):
            task = asyncio.ensure_future(self._feed(self._stream,
                                                    self.progress.count + self.opening))
            self._feeders.add(task)
            task.add_done_callback(self._feeders.discard)
            return Msg(self, subject="_INBOX.x", data=self.admitted)  # type: ignore[arg-type]
        return Msg(self, subject="_INBOX.x", data=self.no_tools)  # type: ignore[arg-type]

    async def _feed(self, sub: Any, opened: int) -> None:
        from nats.aio.msg import Msg

        await self.progress.past(opened - 1)  # the opening events are out: the stream starts
        for data in self.frames:
            sent = self.progress.count
            sub._pending_size += len(data)  # as nats-py's Client._process_msg does
            sub._pending_queue.put_nowait(Msg(self, subject=sub.subject,  # type: ignore[arg-type]
                                              data=data))
            await self.progress.past(sent)

    async def publish(self, *_: Any, **__: Any) -> None:
        pass

    def _remove_sub(self, sid: int) -> None:
        pass

    async def _send_unsubscribe(self, sid: int, limit: int = 0) -> None:
        pass


# ------------------------------------------------------------------ whole requests through ASGI


def text_frames(tokens: int) -> list[bytes]:
    from flotilla.libs.common.messages import TextDelta, TextFinal, TextFrame, Usage, encode

    frames = [TextFrame(request_id="bench-0", seq=i, kind="data",
                        data=TextDelta(text=f" word{i}")) for i in range(tokens)]
    frames.append(TextFrame(request_id="bench-0", seq=tokens, kind="final", final=TextFinal(
        finish_reason="length", usage=Usage(prompt_tokens=100, completion_tokens=tokens))))
    return [encode(f) for f in frames]


async def one_request(app: Any, path: str, body: bytes, progress: Progress) -> int:
    """Drive one POST through the ASGI app; the number of SSE events it sent."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000), "state": {},
             "headers": [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"bench"),
                         (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    never = asyncio.Event()
    out: list[bytes] = []
    status = 0

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message.get("body"):
            out.append(message["body"])
            progress.bump()

    await app(scope, receive, send)
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status}: {b''.join(out)[:300]!r}")
    return b"".join(out).count(b"data: ")


async def whole_requests(requests: int, tokens: int) -> dict[str, float]:
    """CPU ms per streamed request with 1 and with `tokens` tokens, per path."""
    from flotilla.libs.common import telemetry
    from flotilla.libs.common.bus import Bus
    from flotilla.libs.common.messages import Announcement
    from flotilla.libs.common.settings import GatewaySettings
    from flotilla.libs.common.store import MemoryStore
    from flotilla.services.gateway.app import create_app

    settings = GatewaySettings(nats_url="nats://unused", redis_url=None, log_level="WARNING",
                               model_ttl_s=3600)  # type: ignore[call-arg]
    telemetry.setup_tracing("gateway", settings)  # as run_forever (no exporter: no provider)
    out: dict[str, float] = {}
    for path, body, opening in (("/v1/chat/completions", CHAT, 1),
                                ("/v1/completions", COMPLETION, 0)):
        raw = json.dumps(body).encode()
        for k in (1, tokens):
            progress = Progress()
            nc = FakeNC(text_frames(k), progress, opening)
            app = create_app(settings, Bus(nc), MemoryStore())  # type: ignore[arg-type]
            await app.state.gateway.registry.record(Announcement(
                service="tokenizer", instance="bench", model=MODEL, max_model_len=4096))
            for _ in range(20):  # warm-up
                events = await one_request(app, path, raw, progress)
            # + opening, final, usage and [DONE]
            assert events == k + opening + 3, f"{path}: {events} events for {k} tokens"
            t0 = time.process_time()
            for _ in range(requests):
                await one_request(app, path, raw, progress)
            out[f"{path} {k}"] = (time.process_time() - t0) / requests * 1e3
    return out


class BurstNC(FakeNC):
    """FakeNC that notes when each generate request reaches the bus and refuses it (503), so
    a request ends there."""

    def __init__(self) -> None:
        from flotilla.libs.common.messages import Admission, ErrorInfo, encode

        super().__init__([], Progress(), 0)
        self.times: list[float] = []
        self.refused = encode(Admission(request_id="bench", accepted=False, error=ErrorInfo(
            status=503, type="server_error", message="bench")))

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 1.0,
                      headers: Any = None, **_: Any) -> Any:
        from nats.aio.msg import Msg

        if subject.endswith(".generate"):
            self.times.append(time.perf_counter())
            return Msg(self, subject="_INBOX.x", data=self.refused)  # type: ignore[arg-type]
        return Msg(self, subject="_INBOX.x", data=self.no_tools)  # type: ignore[arg-type]


async def burst(n: int = 64, bursts: int = 30) -> dict[str, float]:
    """`n` /v1/completions started together (tasks created at once, as uvicorn does for
    connections whose bytes arrive in one loop turn): ms from the start until the first, the
    median and the last reach the bus, medians over `bursts` (5 more warm up)."""
    from flotilla.libs.common.bus import Bus
    from flotilla.libs.common.messages import Announcement
    from flotilla.libs.common.settings import GatewaySettings
    from flotilla.libs.common.store import MemoryStore
    from flotilla.services.gateway.app import create_app

    settings = GatewaySettings(nats_url="nats://unused", redis_url=None, log_level="WARNING",
                               model_ttl_s=3600)  # type: ignore[call-arg]
    nc = BurstNC()
    app = create_app(settings, Bus(nc), MemoryStore())  # type: ignore[arg-type]
    await app.state.gateway.registry.record(Announcement(
        service="tokenizer", instance="bench", model=MODEL, max_model_len=4096))
    raw = json.dumps(COMPLETION).encode()

    async def one() -> None:
        try:
            await one_request(app, "/v1/completions", raw, Progress())
        except RuntimeError:  # the 503 by design
            pass

    rows = []
    for b in range(bursts + 5):
        nc.times = []
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        ts = sorted((t - t0) * 1e3 for t in nc.times)
        if b >= 5:
            rows.append((ts[0], ts[len(ts) // 2], ts[-1]))
    return {f"burst {k}": statistics.median(r[i] for r in rows)
            for i, k in enumerate(("first", "p50", "last"))}


# ------------------------------------------------------------------ pieces


# ------------------------------------------------------------------ report


def run(coro: Any) -> Any:
    """On uvloop when installed, as the services run (libs/common/service.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--baseline", type=Path, help="another checkout: its whole-request costs too")
    ap.add_argument("--root", type=Path, default=HERE.parents[1], help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(args.root.resolve()))
    now = run(whole_requests(args.requests, args.tokens))
    now.update(run(burst()))
    if args.json:  # the --baseline child
        print(json.dumps(now))
        return
    before: dict[str, float] = {}
    if args.baseline is not None:
        child = subprocess.run([sys.executable, str(HERE), "--root", str(args.baseline),
                                "--json", "--requests", str(args.requests),
                                "--tokens", str(args.tokens)],
                               cwd=args.baseline, capture_output=True, text=True, check=True)
        before = json.loads(child.stdout.strip().splitlines()[-1])

    from bench.gateway_pieces import pieces

    print(f"{'per request / per event (CPU µs)':40s} {'before':>9s} {'now':>9s}")
    for what, was, is_ in pieces(args.tokens):
        print(f"{what:40s} {'' if was is None else f'{was:9.1f}':>9s} {is_:9.1f}")
    k = args.tokens
    print(f"\n{'whole streamed request, ASGI':40s} {'before':>9s} {'now':>9s}")
    for path in ("/v1/chat/completions", "/v1/completions"):
        rows = {}
        for source, values in (("before", before), ("now", now)):
            if values:
                one, many = values[f"{path} 1"], values[f"{path} {k}"]
                per_event = (many - one) / (k - 1)
                rows[source] = (one - per_event, per_event * 1e3, many)
        print(path)
        for i, label in enumerate(("  per request, without events (ms)", "  per event (µs)",
                                   f"  request with {k} events (ms)")):
            cells = [f"{rows[s][i]:9.3f}" if s in rows else "" for s in ("before", "now")]
            print(f"{label:40s} {cells[0]:>9s} {cells[1]:>9s}")
    print(f"\n{'64 /v1/completions at once: reach the bus':40s} {'before':>9s} {'now':>9s}")
    for k in ("first", "p50", "last"):
        was = before.get(f"burst {k}")
        print(f"{'  ' + k + ' (ms after the start)':40s} "
              f"{'' if was is None else f'{was:9.2f}':>9s} {now[f'burst {k}']:9.2f}")

if __name__ == "__main__":
    main()
