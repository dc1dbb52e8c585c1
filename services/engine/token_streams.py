"""The token streams of the engine service's admitted requests (service.py).

Rules:
- `open` starts a request's stream (its writer on the request's `stream_subject` and its trace
  span) once the engine has taken it; from then on exactly one of these ends it: its final frame
  (`on_output` of a finished output), its error frame (`on_output` of a failed one, or `fail`),
  or a cancel (`cancel`: the client is gone, no frame).
- Frames leave in the order the engine produced them: `on_output` queues each send, and the one
  task started by `start` publishes them (per-frame tasks could reorder a stream and would cost a
  task per token). A send that fails is logged; the stream's reader times out on its own.
- `counts` (finished / failed / aborted) and the recently cancelled ids are what the service
  reports in its stats.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from flotilla.libs.common import telemetry
from flotilla.libs.common.bus import Bus, StreamWriter
from flotilla.libs.common.messages import (
    ErrorInfo,
    TokenDelta,
    TokenFinal,
    TokenFrame,
    TokenRequest,
)
from flotilla.services.engine import wire
from flotilla.services.engine.engine import RequestOutput

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("flotilla.engine")


@dataclass
class _Live:
    writer: StreamWriter[TokenDelta, TokenFinal]
    span: trace.Span
    prompt_tokens: int
    t_start: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    generated: int = 0


class TokenStreams:
    def __init__(self, bus: Bus, instance: str, heartbeat_interval_s: float) -> None:
        self.bus, self.instance = bus, instance
        self.heartbeat_interval_s = heartbeat_interval_s
        self._live: dict[str, _Live] = {}
        self.aborted: collections.deque[str] = collections.deque(maxlen=1000)
        self.counts = collections.Counter[str]()
        self._outbox: asyncio.Queue[Coroutine[Any, Any, None]] = asyncio.Queue()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def ids(self) -> list[str]:
        return sorted(self._live)

    def start(self) -> asyncio.Task[Any]:
        """The task that publishes the queued frames (runs until the bus cancels it)."""
        return self.bus.spawn(self._drain_outbox())

    def open(self, req: TokenRequest) -> None:
        span = _tracer.start_span("engine.request", attributes={
            "flotilla.request_id": req.request_id, "flotilla.engine": self.instance,
            "flotilla.prompt_tokens": len(req.prompt_token_ids)})
        writer = self.bus.writer(req.stream_subject, req.request_id, TokenFrame,
                                 self.heartbeat_interval_s)
        self._live[req.request_id] = _Live(writer, span, len(req.prompt_token_ids))

    def on_output(self, out: RequestOutput, now: float) -> None:
        live = self._live.get(out.request_id)
        if live is None:  # cancelled meanwhile; the engine got the abort
            return
        if out.new_token_ids:
            if live.t_first is None:
                live.t_first = now
                live.span.add_event("first_token")
            live.generated += len(out.new_token_ids)
            delta = TokenDelta(token_ids=list(out.new_token_ids), logprobs=wire.logprobs(out))
            if out.prompt_logprobs is not None:
                delta.prompt_logprobs = wire.prompt_logprobs(out.prompt_logprobs)
            self._outbox.put_nowait(live.writer.data(delta))
        if out.error is not None:
            self._live.pop(out.request_id, None)
            self.counts["failed"] += 1
            info = wire.error_info(out.error)
            self._outbox.put_nowait(live.writer.error(info))
            live.span.set_status(trace.StatusCode.ERROR, info.message)
            self._end_span(live, now)
            return
        if out.finished:
            self._live.pop(out.request_id, None)
            self.counts["finished"] += 1
            reason = out.finish_reason if out.finish_reason in ("stop", "length") else "abort"
            final = TokenFinal(finish_reason=reason, prompt_tokens=live.prompt_tokens,
                               completion_tokens=live.generated,
                               cached_tokens=out.num_cached_tokens,
                               stop_token_id=out.stop_token_id)
            self._outbox.put_nowait(live.writer.final(final))
            self._end_span(live, now)

    def cancel(self, request_id: str, reason: str) -> bool:
        """Close a live stream without a frame; False if it is not live."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        live.writer.close()
        live.span.set_attribute("flotilla.cancel_reason", reason)
        live.span.end()
        self.aborted.append(request_id)
        self.counts["aborted"] += 1
        log.info("request %s cancelled (%s)", request_id, reason)
        return True

    async def fail(self, request_id: str, info: ErrorInfo) -> None:
        """End a live stream with an error frame (nothing if it is not live)."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        await live.writer.error(info)
        live.span.set_status(trace.StatusCode.ERROR, info.message)
        live.span.end()

    async def _drain_outbox(self) -> None:
        while True:
            send = await self._outbox.get()
            try:
                await send
            except Exception as exc:  # a closed connection: the readers time out on their own
                log.warning("could not publish a token frame: %s", exc)

    @staticmethod
    def _end_span(live: _Live, now: float) -> None:
        if live.t_first is not None:
            live.span.set_attribute("flotilla.ttft_s", live.t_first - live.t_start)
            live.span.set_attribute("flotilla.decode_s", now - live.t_first)
        live.span.set_attribute("flotilla.completion_tokens", live.generated)
        live.span.end()
