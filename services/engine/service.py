"""The engine service: a thin NATS adapter over `Engine` (services/engine/engine.py).

Per request: the tokenizer asks on `engine_generate(model)`; we validate, reply Admission, and
stream TokenFrames on the request's `stream_subject` until a final or error frame. Cancels (client
gone, stop string) arrive as broadcasts and free the request's KV blocks at once. The Engine itself
runs on the EngineLoop thread; this module never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from libs.common import subjects, telemetry
from libs.common.bus import Bus, StreamWriter
from libs.common.messages import (
    Admission,
    Announcement,
    Cancel,
    EngineStats,
    ErrorInfo,
    StatsRequest,
    TokenDelta,
    TokenFinal,
    TokenFrame,
    TokenLogprob,
    TokenRequest,
)
from libs.common.model_cache import resolve_model, served_name
from libs.common.service import Announcer, instance_id
from libs.common.settings import EngineSettings
from services.engine.core_process import CoreProcess
from services.engine.factory import build_engine, to_sampling_params
from services.engine.loop import EngineLoop

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


class EngineService:
    def __init__(self, settings: EngineSettings, bus: Bus, engine: Any | None = None,
                 on_fatal: Callable[[], None] | None = None):
        """`on_fatal` runs once when the engine breaks (the process's cue to exit)."""
        self.settings, self.bus = settings, bus
        self.instance = settings.engine_id or instance_id("engine")
        self._engine = engine
        self._owns_engine = engine is None  # an injected engine is its owner's to shut down
        self._on_fatal = on_fatal
        self.crashed: BaseException | None = None
        self._live: dict[str, _Live] = {}
        self._aborted: collections.deque[str] = collections.deque(maxlen=1000)
        self._counts = collections.Counter[str]()
        self._subs: list[Any] = []
        self._outbox: asyncio.Queue[Coroutine[Any, Any, None]] = asyncio.Queue()
        self._sender: asyncio.Task[Any] | None = None
        self.model_name = settings.served_model_name or ""
        self.loop: EngineLoop | CoreProcess | None = None
        self._core: CoreProcess | None = None  # FLOTILLA_CORE_PROCESS: engine + loop elsewhere
        self.announcer: Announcer | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._engine is None:
            path = await asyncio.to_thread(resolve_model, self.settings.model)
            self.model_name = self.settings.served_model_name or served_name(self.settings.model,
                                                                             path)
            if self.settings.core_process:  # the engine and its loop live in a child process
                core = CoreProcess(self.settings, path, asyncio.get_running_loop(),
                                   self._on_outputs, self._on_crash, self._on_refused)
                await core.start()
                self._engine = self.loop = self._core = core
            else:
                self._engine = await asyncio.to_thread(build_engine, self.settings, path)
        elif not self.model_name:
            raise ValueError("an injected engine needs settings.served_model_name")
        if self._core is None:
            stepper = EngineLoop.for_service(self._engine, asyncio.get_running_loop(),
                                             self._on_outputs, self._on_crash, self.settings)
            stepper.start()
            self.loop = stepper
        self._sender = self.bus.spawn(self._drain_outbox())
        executor = getattr(self._engine, "executor", None)
        if executor is not None:  # a dead tensor-parallel rank fails the pod at once
            loop = asyncio.get_running_loop()
            executor.on_failure(lambda exc: loop.call_soon_threadsafe(self._on_crash, exc))
        self._subs.append(await self.bus.serve(subjects.engine_generate(self.model_name),
                                               TokenRequest, self._on_generate, queue="engine"))
        self._subs.append(await self.bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel))
        self._subs.append(await self.bus.serve(subjects.engine_stats(self.instance), StatsRequest,
                                               self._on_stats))
        self.announcer = Announcer(self.bus, "engine", self.instance,
                                   self.settings.discovery_interval_s, self._announcement,
                                   self._health, self._heartbeat_age)
        await self.announcer.start()
        log.info("engine %s serving %s", self.instance, self.model_name)

    async def stop(self) -> None:
        if self.announcer:
            await self.announcer.stop()
        await self.bus.unsubscribe_all(self._subs)
        for rid in list(self._live):
            await self._fail(rid, ErrorInfo(status=503, type="service_unavailable",
                                            message="the engine is shutting down"))
        if self.loop:
            await asyncio.to_thread(self.loop.stop)
        shutdown = getattr(self._engine, "shutdown", None)
        if self._owns_engine and shutdown is not None:
            await asyncio.to_thread(shutdown)

    # ------------------------------------------------------------------ handlers

    async def _on_generate(self, req: TokenRequest) -> Admission:
        assert self.loop is not None and self._engine is not None
        if self.crashed is not None:
            return self._refuse(req, 503, f"the engine failed: {self.crashed}")
        vocab = self._engine.vocab_size
        if not req.prompt_token_ids:
            return self._refuse(req, 400, "the prompt is empty")
        if max(req.prompt_token_ids) >= vocab or min(req.prompt_token_ids) < 0:
            return self._refuse(req, 400, f"prompt token ids must be in [0, {vocab})")
        if req.request_id in self._live:
            return self._refuse(req, 400, f"request id {req.request_id} is already running")
        params: Any
        try:
            if self._core is not None:  # checked here, converted (a grammar compiled) there
                to_sampling_params(req.sampling.model_copy(update={"guided": None}),
                                   len(req.prompt_token_ids), self._engine.max_model_len)
                params = req.sampling
            else:
                params = to_sampling_params(req.sampling, len(req.prompt_token_ids),
                                            self._engine.max_model_len, self._engine)
        except ValueError as exc:
            return self._refuse(req, 400, str(exc))
        span = _tracer.start_span("engine.request", attributes={
            "flotilla.request_id": req.request_id, "flotilla.engine": self.instance,
            "flotilla.prompt_tokens": len(req.prompt_token_ids)})
        writer = self.bus.writer(req.stream_subject, req.request_id, TokenFrame,
                                 self.settings.heartbeat_interval_s)
        self._live[req.request_id] = _Live(writer, span, len(req.prompt_token_ids))
        self.loop.add(req.request_id, req.prompt_token_ids, params)
        return Admission(request_id=req.request_id, accepted=True, instance=self.instance,
                         prompt_tokens=len(req.prompt_token_ids))

    def _on_refused(self, request_id: str, message: str) -> None:
        """The core process could not take an admitted request (its grammar did not compile)."""
        self.bus.spawn(self._fail(request_id, ErrorInfo(
            status=400, type="invalid_request_error", message=message)))

    def _refuse(self, req: TokenRequest, status: int, message: str) -> Admission:
        kind = "invalid_request_error" if status == 400 else "server_error"
        return Admission(request_id=req.request_id, accepted=False, instance=self.instance,
                         error=ErrorInfo(status=status, type=kind, message=message))

    async def _on_cancel(self, msg: Cancel) -> None:
        live = self._live.pop(msg.request_id, None)
        if live is None or self.loop is None:
            return
        self.loop.abort(msg.request_id)
        live.writer.close()
        live.span.set_attribute("flotilla.cancel_reason", msg.reason)
        live.span.end()
        self._aborted.append(msg.request_id)
        self._counts["aborted"] += 1
        log.info("request %s cancelled (%s)", msg.request_id, msg.reason)

    async def _on_stats(self, _: StatsRequest) -> EngineStats:
        return self._engine_stats()

    # ------------------------------------------------------------------ engine outputs

    def _on_outputs(self, outputs: list[Any]) -> None:
        now = time.monotonic()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:  # cancelled meanwhile; the engine got the abort
                continue
            if out.new_token_ids:
                if live.t_first is None:
                    live.t_first = now
                    live.span.add_event("first_token")
                live.generated += len(out.new_token_ids)
                logprobs = _logprobs(out)
                self._outbox.put_nowait(live.writer.data(
                    TokenDelta(token_ids=list(out.new_token_ids), logprobs=logprobs)))
            if out.finished:
                self._live.pop(out.request_id, None)
                self._counts["finished"] += 1
                reason = out.finish_reason if out.finish_reason in ("stop", "length") else "abort"
                final = TokenFinal(finish_reason=reason, prompt_tokens=live.prompt_tokens,
                                   completion_tokens=live.generated,
                                   cached_tokens=getattr(out, "num_cached_tokens", 0) or 0,
                                   stop_token_id=getattr(out, "stop_token_id", None))
                self._outbox.put_nowait(live.writer.final(final))
                self._end_span(live, now)

    async def _drain_outbox(self) -> None:
        """The one task that publishes token frames, in the order the engine produced them
        (per-frame tasks could reorder a stream and cost a task per token)."""
        while True:
            send = await self._outbox.get()
            try:
                await send
            except Exception as exc:  # a closed connection: the readers time out on their own
                log.warning("could not publish a token frame: %s", exc)

    def _end_span(self, live: _Live, now: float) -> None:
        if live.t_first is not None:
            live.span.set_attribute("flotilla.ttft_s", live.t_first - live.t_start)
            live.span.set_attribute("flotilla.decode_s", now - live.t_first)
        live.span.set_attribute("flotilla.completion_tokens", live.generated)
        live.span.end()

    def _on_crash(self, exc: BaseException) -> None:
        """The engine is broken (its loop crashed, or a tensor-parallel rank died): fail every
        live request, stop announcing (health stops answering) and call on_fatal once."""
        first = self.crashed is None
        self.crashed = self.crashed or exc
        for rid in list(self._live):
            self.bus.spawn(self._fail(rid, ErrorInfo(
                status=500, type="server_error", message=f"the engine failed: {exc}")))
        if first:
            if self.announcer is not None:
                self.bus.spawn(self.announcer.stop())
            if self._on_fatal is not None:
                self._on_fatal()

    async def _fail(self, rid: str, info: ErrorInfo) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        await live.writer.error(info)
        live.span.set_status(trace.StatusCode.ERROR, info.message)
        live.span.end()

    # ------------------------------------------------------------------ discovery

    def _engine_stats(self) -> EngineStats:
        s = self.loop.stats() if self.loop else {}
        return EngineStats(
            engine_id=self.instance, model=self.model_name,
            running=s.get("running", 0), waiting=s.get("waiting", 0),
            requests_finished=self._counts["finished"], requests_aborted=self._counts["aborted"],
            tokens_generated=s.get("tokens_generated", 0), prompt_tokens=s.get("prompt_tokens", 0),
            cached_prompt_tokens=s.get("cached_prompt_tokens", 0),
            kv_blocks_total=s.get("kv_blocks_total", 0), kv_blocks_used=s.get("kv_blocks_used", 0),
            active_request_ids=sorted(self._live), aborted_request_ids=list(self._aborted))

    def _announcement(self) -> Announcement:
        s = self.loop.stats() if self.loop else {}
        total = s.get("kv_blocks_total", 0) or 1
        return Announcement(service="engine", instance=self.instance, model=self.model_name,
                            max_model_len=self._engine.max_model_len if self._engine else None,
                            running=s.get("running", 0), waiting=s.get("waiting", 0),
                            kv_usage=s.get("kv_blocks_used", 0) / total)

    async def _health(self) -> dict[str, Any]:
        return self._engine_stats().model_dump()

    def _heartbeat_age(self) -> float | None:
        """Seconds since the step loop last went round (loop.py: it beats while idle too)."""
        beat = self.loop.stats().get("heartbeat") if self.loop else None
        return None if beat is None else max(0.0, time.monotonic() - beat)


def _logprobs(out: Any) -> list[TokenLogprob] | None:
    raw = getattr(out, "logprobs", None)
    if not raw:
        return None
    return [TokenLogprob(token_id=t, logprob=lp, top=list(top)) for t, lp, top in raw]
