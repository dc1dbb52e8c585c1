"""The tokenizer service: the NATS adapter between gateways and engines for one model.

Per request (subjects in libs/common/subjects.py):
1. `tokenizer_generate(model)` brings a TextRequest; the prompt is rendered and tokenized and its
   grammar checked on bounded worker lanes (preparation.py: cost caps, light / heavy / grammar
   lanes, deadlines). A bad request is refused with its 400 (overload: 503 with Retry-After; a
   passed deadline: 504) before any stream exists.
2. A reader opens on `token_stream(rid)`, then `engine_generate(model)` gets the TokenRequest. An
   engine refusal (or none serving: 503) is passed on as the refusal.
3. The gateway gets Admission(accepted); a task then turns TokenFrames into TextFrames on the
   request's `stream_subject` (OutputProcessor). The writer beats while the engine is silent
   (long prefill); an engine error frame or a dead engine becomes an error frame, never a hang;
   so does a finished structured output that breaks its response format (output_check.py).
4. A stop-string match publishes Cancel(stop_string), so the engine frees the request, and sends
   the final. A gateway Cancel drops the request here (the engine hears the same broadcast).
Ownership: the service owns each request's reader, writer and task (`_Active`) from admission
until the task ends; the task's `finally` releases them. One span "tokenizer.generate" per
request, a child of the gateway's; the engine request carries it onward. `start()` warms what a
first request would load (warmup.py: xgrammar, the template, every grammar kind) before it
subscribes and announces, so the first request after a start pays nothing extra. The context
length requests are checked against is the one the engines publish (engine_context.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.subscription import Subscription
from opentelemetry import trace

from flotilla.libs.common import subjects, telemetry
from flotilla.libs.common.bus import Bus, StreamReader, StreamWriter
from flotilla.libs.common.errors import FlotillaError, internal, unavailable
from flotilla.libs.common.messages import (
    Admission,
    Announcement,
    Cancel,
    Ping,
    RenderReply,
    TextDelta,
    TextFinal,
    TextFrame,
    TextRequest,
    TokenDelta,
    TokenFinal,
    TokenFrame,
    TokenRequest,
)
from flotilla.libs.common.metrics import MetricsServer
from flotilla.libs.common.model_cache import resolve_model, served_name
from flotilla.libs.common.model_capabilities import model_kind
from flotilla.libs.common.service import Announcer, instance_id, wait_idle
from flotilla.libs.common.settings import TokenizerSettings
from flotilla.services.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from flotilla.services.tokenizer.embed import Embedder, serve_embed
from flotilla.services.tokenizer.engine_context import EngineContext
from flotilla.services.tokenizer.gguf_metadata import gguf_pooling_type
from flotilla.services.tokenizer.metrics import TokenizerMetrics
from flotilla.services.tokenizer.output import OutputProcessor
from flotilla.services.tokenizer.preparation import Preparer, check_deadline
from flotilla.services.tokenizer.prompt import PreparedPrompt, PromptBuilder
from flotilla.services.tokenizer.scoring import Scorer, score_mode, serve_score
from flotilla.services.tokenizer.token_codec import TokenCodec, serve_token_codec
from flotilla.services.tokenizer.tokenizer import Tokenizer
from flotilla.services.tokenizer.warmup import warm_up

log = logging.getLogger(__name__)
tracer = telemetry.tracer("flotilla.tokenizer")

_CANCEL_MEMORY_S = 30.0  # how long a cancel for a not-yet-admitted request is remembered
_ENGINE_SILENT_PERIODS = 5  # an engine unheard for this many discovery periods no longer counts


def resolve_max_model_len(model_len: int | None, cap: int | None) -> int:
    known = [n for n in (model_len, cap) if n is not None]
    if not known:
        raise ValueError("the model does not state its context length; "
                         "set FLOTILLA_MAX_MODEL_LEN")
    return min(known)


@dataclass
class _Active:
    reader: StreamReader[TokenDelta, TokenFinal]
    writer: StreamWriter[TextDelta, TextFinal]
    task: asyncio.Task[None] | None = None


class TokenizerService:
    """Serves one model's tokenizer subjects; `start()` loads the tokenizer (seconds)."""

    def __init__(self, settings: TokenizerSettings, bus: Bus, tokenizer: Tokenizer | None = None):
        self.settings, self.bus = settings, bus
        self.instance = instance_id("tokenizer")
        self.tokenizer = tokenizer
        self.model = settings.served_model_name or ""
        self.builder: PromptBuilder | None = None
        self.preparer: Preparer | None = None
        self._active: dict[str, _Active] = {}
        self.metrics: TokenizerMetrics | None = None
        self._metrics_server: MetricsServer | None = None
        self._cancelled: dict[str, float] = {}
        self._subs: list[Subscription] = []
        self._work_subs: list[Subscription] = []
        self._announcer: Announcer | None = None
        self.context: EngineContext | None = None
        self._codec: TokenCodec | None = None
        self._embedder: Embedder | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        path = await asyncio.to_thread(resolve_model, s.model)
        self.model = s.served_model_name or served_name(s.model, path)
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(Tokenizer.from_path, path)
        override = None
        if s.chat_template is not None:
            override = s.chat_template.read_text(encoding="utf-8")
            try:
                ChatTemplate(override)
            except ChatTemplateError as exc:
                raise ValueError(f"FLOTILLA_CHAT_TEMPLATE {s.chat_template}: {exc}") from None
        max_len = resolve_max_model_len(self.tokenizer.max_model_len, s.max_model_len)
        self.context = EngineContext(self.model, max_len, _ENGINE_SILENT_PERIODS
                                     * s.discovery_interval_s)
        self.builder = PromptBuilder(self.tokenizer, max_len, override, s.template_timeout_s,
                                     s.max_prompt_chars)
        self._codec = TokenCodec(self.tokenizer, max_len)
        self.preparer = Preparer(self.builder, s)
        self.metrics = TokenizerMetrics(self.model, lambda: len(self._active))
        self._metrics_server = MetricsServer(self.metrics.registry, s.metrics_host,
                                             s.metrics_port)
        self._metrics_server.start()
        embedder = self._embedder = Embedder(self.tokenizer, max_len)
        kind = model_kind(path, [self.model, str(path)], gguf_pooling_type(path))
        mode = score_mode(s.score_mode, self.tokenizer, kind)
        took = await asyncio.to_thread(warm_up, self.builder)
        log.info("tokenizer warm-up (template, xgrammar, grammars) took %.1fs", took)
        self._work_subs = [  # new work: left first when draining
            await self.bus.serve(subjects.tokenizer_generate(self.model), TextRequest,
                                 self._generate, queue="tokenizer"),
            await self.bus.serve(subjects.tokenizer_render(self.model), TextRequest,
                                 self._render, queue="tokenizer"),
            await serve_embed(self.bus, self.model, embedder, s.request_timeout_s),
            await serve_score(self.bus, self.model, Scorer(embedder, mode), s.request_timeout_s),
        ]
        self._subs = [
            await self.bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel),
            *await serve_token_codec(self.bus, self.model, self._codec),
            await self.bus.subscribe(subjects.DISCOVERY_ANNOUNCE, Announcement,
                                     self._on_announcement),
        ]
        self._announcer = Announcer(
            self.bus, "tokenizer", self.instance, s.discovery_interval_s,
            make=lambda: Announcement(service="tokenizer", instance=self.instance,
                                      model=self.model, max_model_len=self.builder_length(),
                                      running=len(self._active)),
            health=self._health)
        await self._announcer.start()
        await self.bus.publish(subjects.DISCOVERY_PING, Ping())  # engines: say your length now
        log.info("tokenizer for %s (%s) ready, max_model_len=%d, score mode %s", self.model,
                 path, max_len, mode)

    async def drain(self, timeout_s: float) -> None:
        """Take no new generate, render, embed or score requests (other tokenizers of the model
        get them) and let the streams in flight finish, up to `timeout_s`."""
        if self._announcer is not None:
            self._announcer.draining = True
        await self.bus.unsubscribe_all(self._work_subs)
        if not await wait_idle(lambda: len(self._active), timeout_s):
            log.warning("tokenizer %s: %d streams unfinished after the %gs drain", self.instance,
                        len(self._active), timeout_s)

    def builder_length(self) -> int:
        assert self.builder is not None
        return self.builder.max_model_len

    async def _on_announcement(self, ann: Announcement) -> None:
        """An engine's published context length becomes the one requests are checked against
        (engine_context.py)."""
        if (self.context is None or self.builder is None or self._codec is None
                or self._embedder is None):
            return
        self.context.heard(ann)
        length = self.context.length()
        if length != self.builder.max_model_len:
            log.info("max_model_len of %s is now %d (the engines' published context length)",
                     self.model, length)
        self.builder.max_model_len = self._codec.max_model_len = length
        self._embedder.max_model_len = length

    async def stop(self) -> None:
        await self.bus.unsubscribe_all(self._work_subs)
        await self.bus.unsubscribe_all(self._subs)
        if self.preparer is not None:
            self.preparer.shutdown()
        if self._announcer:
            await self._announcer.stop()
        for rid, active in list(self._active.items()):
            await self._safe_publish(Cancel(request_id=rid, reason="shutdown"))
            await active.writer.error(unavailable("the tokenizer service is shutting down").info)
            if active.task:
                active.task.cancel()
        if self._metrics_server is not None:
            self._metrics_server.stop()

    async def _health(self) -> dict[str, Any]:
        return {"model": self.model, "active": len(self._active)}

    # ------------------------------------------------------------------ handlers

    async def _prepare(self, req: TextRequest) -> PreparedPrompt:
        assert self.preparer is not None
        return await self.preparer.prepare(req)

    async def _render(self, req: TextRequest) -> RenderReply:
        assert self.builder is not None
        try:
            prepared = await self._prepare(req)
        except FlotillaError as exc:
            return RenderReply(error=exc.info)
        return RenderReply(prompt=prepared.text, token_ids=prepared.token_ids,
                           max_model_len=self.builder.max_model_len)

    async def _generate(self, req: TextRequest) -> Admission:
        rid = req.request_id
        span = tracer.start_span("tokenizer.generate", attributes={
            "flotilla.request_id": rid, "flotilla.model": self.model, "flotilla.kind": req.kind})
        with trace.use_span(span, end_on_exit=False):
            try:
                admission = await self._admit(req, span)
            except FlotillaError as exc:
                admission = Admission(request_id=rid, accepted=False, error=exc.info)
            except Exception as exc:
                log.exception("request %s failed before streaming", rid)
                admission = Admission(request_id=rid, accepted=False,
                                      error=internal(f"tokenizer failure: {exc}").info)
        if not admission.accepted:
            if self.metrics is not None and admission.error is not None:
                self.metrics.refused(admission.error)
            span.set_status(trace.Status(trace.StatusCode.ERROR,
                                         admission.error.message if admission.error else ""))
            span.end()
        return admission

    async def _admit(self, req: TextRequest, span: trace.Span) -> Admission:
        assert self.builder is not None
        rid = req.request_id
        assert self.metrics is not None
        started = time.monotonic()
        prepared = await self._prepare(req)
        self.metrics.prepare.observe(time.monotonic() - started)
        sampling = self.builder.sampling(req, len(prepared.token_ids), prepared.guided)
        check_deadline(req, "before the engine got it")
        span.set_attribute("flotilla.prompt_tokens", len(prepared.token_ids))
        stream = subjects.token_stream(rid)
        reader = await self.bus.open_reader(stream, TokenFrame, self.settings.heartbeat_timeout_s)
        try:
            sent = time.monotonic()
            engine = await self.bus.request(
                subjects.engine_generate(self.model),
                TokenRequest(request_id=rid, model=self.model, prompt_token_ids=prepared.token_ids,
                             sampling=sampling, stream_subject=stream, priority=req.priority,
                             deadline=req.deadline),
                Admission, timeout=self.settings.request_timeout_s)
            self.metrics.engine.observe(time.monotonic() - sent)
            if not engine.accepted:
                refused = engine.error or unavailable("the engine refused the request").info
                raise FlotillaError(refused)
            if self._was_cancelled(rid):
                await self._safe_publish(Cancel(request_id=rid, reason="client_disconnect"))
                raise FlotillaError(unavailable("the request was cancelled").info)
        except BaseException:
            await reader.close()
            raise
        writer = self.bus.writer(req.stream_subject, rid, TextFrame,
                                 self.settings.heartbeat_interval_s)
        active = _Active(reader, writer)
        self._active[rid] = active
        stop_ids = frozenset(sampling.stop_token_ids)
        active.task = self.bus.spawn(self._stream(req, prepared, active, span, stop_ids))
        return Admission(request_id=rid, accepted=True, instance=self.instance,
                         prompt_tokens=len(prepared.token_ids))

    async def _stream(self, req: TextRequest, prepared: PreparedPrompt, active: _Active,
                      span: trace.Span, stop_ids: frozenset[int]) -> None:
        """Engine token frames -> gateway text frames, until a final, a stop string or an error."""
        assert self.tokenizer is not None
        rid, writer = req.request_id, active.writer
        assert self.builder is not None
        proc = OutputProcessor.for_request(self.tokenizer, req, prepared.text,
                                           len(prepared.token_ids), self.builder.tool_format(),
                                           stop_ids, first_prompt_id=next(
                                               iter(prepared.token_ids), None))
        try:
            if prepared.echo:
                await writer.data(TextDelta(text=prepared.echo))
            async for frame in active.reader:
                if frame.kind == "data" and frame.data is not None:
                    if (delta := proc.on_tokens(frame.data)) is not None:
                        await writer.data(delta)
                    if proc.stopped:
                        await self._safe_publish(Cancel(request_id=rid, reason="stop_string"))
                        await self._finish(proc, writer, proc.stop_final())
                        break
                elif frame.kind == "final" and frame.final is not None:
                    delta, final = proc.on_final(frame.final)
                    if delta is not None:
                        await writer.data(delta)
                    await self._finish(proc, writer, final)
                    span.set_attribute("flotilla.finish_reason", final.finish_reason)
                    span.set_attribute("flotilla.completion_tokens",
                                       final.usage.completion_tokens)
        except FlotillaError as exc:
            # engine error frame, lost frame or dead engine: tell the gateway, free the engine
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.info.message))
            await self._safe_publish(Cancel(request_id=rid, reason="deadline"))
            await writer.error(exc.info)
        except asyncio.CancelledError:
            writer.close()  # the gateway cancelled; it expects nothing more
        except Exception as exc:
            log.exception("request %s failed while streaming", rid)
            await self._safe_publish(Cancel(request_id=rid, reason="deadline"))
            await writer.error(internal(f"tokenizer failure: {exc}").info)
        finally:
            if not writer.closed:  # the engine stream ended without a final
                await writer.error(internal("the engine stream ended without a final").info)
            await active.reader.close()
            self._active.pop(rid, None)
            span.end()

    @staticmethod
    async def _finish(proc: OutputProcessor, writer: StreamWriter[TextDelta, TextFinal],
                      final: TextFinal) -> None:
        """The final frame, or the error of an output that broke its response format."""
        error = proc.final_error(final)
        if error is not None:
            await writer.error(error)
        else:
            await writer.final(final)

    async def _on_cancel(self, msg: Cancel) -> None:
        if msg.reason == "stop_string":  # sent by a tokenizer (maybe this one) to the engines
            return
        active = self._active.get(msg.request_id)
        if active is None:
            self._remember_cancel(msg.request_id)
            return
        active.writer.close()
        if active.task is not None:
            active.task.cancel()

    # ------------------------------------------------------------------ helpers

    def _remember_cancel(self, rid: str) -> None:
        now = time.monotonic()
        for old, at in list(self._cancelled.items()):
            if now - at > _CANCEL_MEMORY_S:
                del self._cancelled[old]
        self._cancelled[rid] = now

    def _was_cancelled(self, rid: str) -> bool:
        return self._cancelled.pop(rid, None) is not None

    async def _safe_publish(self, msg: Cancel) -> None:
        try:
            await self.bus.publish(subjects.CANCEL, msg)
        except Exception as exc:  # reconnecting: the engine's own timeout frees the request
            log.warning("could not publish %s cancel for %s: %s", msg.reason, msg.request_id, exc)

