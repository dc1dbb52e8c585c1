"""The engine service: a thin NATS adapter over `Engine` (services/engine/engine.py).

Per request: the tokenizer asks on `engine_generate(model)`; we check it (admission.py: every
sampling value against the engine's ranges -> 400 naming it; a passed deadline -> 504; a full
queue -> 503 with retry_after_s), compile its grammar if it has one (structured.py, off the
event loop, bounded in time: 503 past it, 400 for a grammar that cannot compile), reply
Admission, and stream TokenFrames on the request's `stream_subject` until a final or error
frame. A request that fails on its own in the engine (its deadline, its sampling, its grammar)
gets an error frame with the engine's status; the others go on (the streams themselves:
token_streams.py). Cancels (client gone, stop string) arrive as broadcasts and free the
request's KV blocks at once. The Engine itself runs on the EngineLoop thread; this module never
blocks the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.context import ContextLengthExceeded
from flotilla.libs.common.messages import (
    Admission,
    Announcement,
    Cancel,
    EngineStats,
    ErrorInfo,
    GuidedDecoding,
    StatsRequest,
    TokenRequest,
)
from flotilla.libs.common.metrics import MetricsServer
from flotilla.libs.common.model_cache import resolve_model, served_name
from flotilla.libs.common.model_capabilities import Capability, capabilities, model_kind
from flotilla.libs.common.pooling_messages import PoolRequest
from flotilla.libs.common.service import Announcer, instance_id, wait_idle
from flotilla.libs.common.settings import EngineSettings
from flotilla.services.engine import wire
from flotilla.services.engine.admission import QueueLimits, check_deadline, to_sampling_params
from flotilla.services.engine.engine import RequestOutput
from flotilla.services.engine.factory import build_engine
from flotilla.services.engine.loop import EngineLoop
from flotilla.services.engine.metrics import EngineMetrics
from flotilla.services.engine.pool_service import PoolService
from flotilla.services.engine.request_error import InvalidParameter, RequestError
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.served_engine import ServedEngine
from flotilla.services.engine.structured import GrammarCompileTimeout, StructuredOutputs
from flotilla.services.engine.token_streams import TokenStreams

log = logging.getLogger(__name__)


class EngineService:
    def __init__(self, settings: EngineSettings, bus: Bus, engine: ServedEngine | None = None,
                 on_fatal: Callable[[], None] | None = None):
        """`on_fatal` runs once when the engine breaks (the process's cue to exit)."""
        self.settings, self.bus = settings, bus
        self.instance = settings.engine_id or instance_id("engine")
        self._engine: ServedEngine | None = engine
        self._owns_engine = engine is None  # an injected engine is its owner's to shut down
        self._on_fatal = on_fatal
        self.crashed: BaseException | None = None
        # the admitted requests' token streams (token_streams.py)
        self.streams = TokenStreams(bus, self.instance, settings.heartbeat_interval_s)
        self._refusals = collections.Counter[str]()  # overload refusals by cause (error code)
        self.metrics: EngineMetrics | None = None
        self._metrics_server: MetricsServer | None = None
        self._subs: list[Any] = []
        self._sender: asyncio.Task[Any] | None = None
        self.model_name = settings.served_model_name or ""
        self.loop: EngineLoop | None = None
        self.structured: StructuredOutputs | None = None
        self.limits = QueueLimits(settings.max_waiting_requests, settings.max_waiting_tokens)
        self.announcer: Announcer | None = None
        self.capabilities: list[Capability] | None = None  # what the model serves (announced)
        self.pool: PoolService | None = None  # embeddings, score, rerank (pool_service.py)
        # the one thread that builds and then steps the engine (loop.py)
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-loop")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._engine is None:
            path = await asyncio.to_thread(resolve_model, self.settings.model)
            self.model_name = self.settings.served_model_name or served_name(self.settings.model,
                                                                             path)
            # built on the thread that will step it (loop.py: one OpenMP pool on CPU)
            self._engine = await asyncio.get_running_loop().run_in_executor(
                self._engine_thread, build_engine, self.settings, path)
        elif not self.model_name:
            raise ValueError("an injected engine needs settings.served_model_name")
        self.loop = EngineLoop.for_service(self._engine, asyncio.get_running_loop(),
                                           self._on_outputs, self._on_crash, self.settings,
                                           executor=self._engine_thread)
        self.metrics = EngineMetrics(self.model_name, self.instance, self.loop.stats,
                                     lambda: dict(self._refusals))
        self.loop.on_step = self.metrics.observe_step
        self._metrics_server = MetricsServer(self.metrics.registry, self.settings.metrics_host,
                                             self.settings.metrics_port)
        self._metrics_server.start()
        self.loop.start()
        s, engine = self.settings, self._engine
        assert engine is not None
        model_dir = Path(engine.config.model).expanduser()
        if not model_dir.exists():  # the default or a hub id: resolved (and cached) already
            model_dir = await asyncio.to_thread(resolve_model, engine.config.model)
        self.capabilities = capabilities(model_kind(
            model_dir, [self.model_name, str(model_dir)],
            engine.model_config.hf_config.get("gguf_pooling_type")))
        self.pool = PoolService(engine, self.loop, self.limits, lambda: self.crashed)
        self.structured = StructuredOutputs(
            engine.config.model, engine.vocab_size, sorted(engine.eos_token_ids),
            s.grammar_cache_entries, s.grammar_cache_mib << 20, s.grammar_compile_workers,
            s.grammar_max_pending, s.grammar_compile_timeout_s)
        # the compiler's vocabulary and xgrammar itself load now, not in a user's first request
        self.structured.compile_async(GuidedDecoding(kind="json_object"))
        self._sender = self.streams.start()
        loop = asyncio.get_running_loop()

        def rank_failed(exc: BaseException) -> None:  # a dead tensor-parallel rank fails the pod
            loop.call_soon_threadsafe(self._on_crash, exc)

        engine.executor.on_failure(rank_failed)
        self._subs.append(await self.bus.serve(subjects.engine_generate(self.model_name),
                                               TokenRequest, self._on_generate, queue="engine"))
        self._subs.append(await self.bus.serve(subjects.engine_pool(self.model_name),
                                               PoolRequest, self.pool.handle, queue="engine"))
        self._subs.append(await self.bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel))
        self._subs.append(await self.bus.serve(subjects.engine_stats(self.instance), StatsRequest,
                                               self._on_stats))
        self.announcer = Announcer(self.bus, "engine", self.instance,
                                   self.settings.discovery_interval_s, self._announcement,
                                   self._health, self._heartbeat_age)
        await self.announcer.start()
        log.info("engine %s serving %s", self.instance, self.model_name)

    async def drain(self, timeout_s: float) -> None:
        """Take no new requests (other engines of the model get them; with none, the tokenizer
        answers 503) and let the running ones finish, up to `timeout_s`. A broken engine (its
        own SIGTERM after a crash) has nothing to finish."""
        if self.crashed is not None:
            return
        if self.announcer is not None:
            self.announcer.draining = True
        if self._subs:
            await self.bus.unsubscribe_all(self._subs[:2])  # engine_generate, engine_pool
            del self._subs[:2]
        pool = self.pool
        if not await wait_idle(lambda: len(self.streams) + (pool.pending if pool else 0),
                               timeout_s):
            log.warning("engine %s: %d requests unfinished after the %gs drain", self.instance,
                        len(self.streams), timeout_s)

    async def stop(self) -> None:
        if self.announcer:
            await self.announcer.stop()
        await self.bus.unsubscribe_all(self._subs)
        for rid in self.streams.ids():
            await self.streams.fail(rid, ErrorInfo(status=503, type="service_unavailable",
                                                   message="the engine is shutting down"))
        if self.loop:
            await asyncio.to_thread(self.loop.stop)
        if self.structured is not None:
            self.structured.shutdown()
        if self._owns_engine and self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)
        self._engine_thread.shutdown(wait=False)
        if self._metrics_server is not None:
            self._metrics_server.stop()

    # ------------------------------------------------------------------ handlers

    async def _on_generate(self, req: TokenRequest) -> Admission:
        assert self.loop is not None and self._engine is not None
        if self.crashed is not None:
            return self._refuse(req, RequestError(f"the engine failed: {self.crashed}", 503,
                                                  "service_unavailable", "engine_failed"))
        refusal = self._check(req)
        if isinstance(refusal, RequestError):
            return self._refuse(req, refusal)
        params = refusal
        if req.sampling.guided is not None:
            try:
                params.guided = await self._guided(req)
            except RequestError as exc:
                return self._refuse(req, exc)
            if req.request_id in self.streams:  # the same id came again while this one compiled
                return self._refuse(req, _invalid(f"request id {req.request_id} is already "
                                                  "running", "request_id"))
        self.streams.open(req)
        self.loop.add(req.request_id, req.prompt_token_ids, params, req.priority, req.deadline)
        return Admission(request_id=req.request_id, accepted=True, instance=self.instance,
                         prompt_tokens=len(req.prompt_token_ids))

    def _check(self, req: TokenRequest) -> SamplingParams | RequestError:
        """The request's params, or why it is refused (see admission.py)."""
        assert self.loop is not None and self._engine is not None
        vocab, ids = self._engine.vocab_size, req.prompt_token_ids
        if not ids:
            return _invalid("the prompt is empty", "prompt")
        if max(ids) >= vocab or min(ids) < 0:
            return _invalid(f"prompt token ids must be in [0, {vocab})", "prompt")
        if req.request_id in self.streams:
            return _invalid(f"request id {req.request_id} is already running", "request_id")
        late = check_deadline(req.deadline)
        if late is not None:
            return late
        try:
            params = to_sampling_params(req.sampling, len(ids), self._engine.max_model_len,
                                        vocab)
        except InvalidParameter as exc:
            return _invalid(str(exc), exc.param)
        except ContextLengthExceeded as exc:
            return RequestError(str(exc), 400, "invalid_request_error", "context_length_exceeded",
                                param=exc.param)
        queue = self.loop.queue_state()
        full = self.limits.check(queue.waiting, queue.waiting_tokens, len(ids),
                                 queue.tokens_per_s)
        return params if full is None else full

    async def _guided(self, req: TokenRequest) -> Any:
        """The request's grammar state, compiled off the event loop within its time limit."""
        assert self.structured is not None and req.sampling.guided is not None
        future = self.structured.compile_async(req.sampling.guided)
        timeout = self.settings.grammar_compile_timeout_s
        try:  # shielded: a timeout must not cancel the compile (its result gets cached)
            compiled = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                              timeout)
        except TimeoutError:
            raise GrammarCompileTimeout(timeout, timeout) from None
        return self.structured.guided(compiled, req.sampling.stop_token_ids,
                                      req.sampling.ignore_eos)

    def _refuse(self, req: TokenRequest, error: RequestError) -> Admission:
        if error.status >= 500 or error.status == 429:
            self._refusals[error.code or error.type] += 1
        return Admission(request_id=req.request_id, accepted=False, instance=self.instance,
                         error=wire.error_info(error))

    async def _on_cancel(self, msg: Cancel) -> None:
        if self.pool is not None and self.pool.cancel(msg.request_id):
            return
        if self.loop is not None and self.streams.cancel(msg.request_id, msg.reason):
            self.loop.abort(msg.request_id)

    async def _on_stats(self, _: StatsRequest) -> EngineStats:
        return self._engine_stats()

    # ------------------------------------------------------------------ engine outputs

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            if self.pool is not None and self.pool.on_output(out):
                continue
            self.streams.on_output(out, now)

    def _on_crash(self, exc: BaseException) -> None:
        """The engine is broken (its loop crashed, or a tensor-parallel rank died): fail every
        live request, stop announcing (health stops answering) and call on_fatal once."""
        first = self.crashed is None
        self.crashed = self.crashed or exc
        if self.pool is not None:
            self.pool.fail_all(RequestError(f"the engine failed: {exc}", 500))
        for rid in self.streams.ids():
            self.bus.spawn(self.streams.fail(rid, ErrorInfo(
                status=500, type="server_error", message=f"the engine failed: {exc}")))
        if first:
            if self.announcer is not None:
                self.bus.spawn(self.announcer.stop())
            if self._on_fatal is not None:
                self._on_fatal()

    # ------------------------------------------------------------------ discovery

    def _engine_stats(self) -> EngineStats:
        s = self.loop.stats() if self.loop else {}
        return EngineStats(
            engine_id=self.instance, model=self.model_name,
            running=s.get("running", 0), waiting=s.get("waiting", 0),
            requests_finished=self.streams.counts["finished"],
            requests_aborted=self.streams.counts["aborted"],
            tokens_generated=s.get("tokens_generated", 0), prompt_tokens=s.get("prompt_tokens", 0),
            cached_prompt_tokens=s.get("cached_prompt_tokens", 0),
            kv_blocks_total=s.get("kv_blocks_total", 0), kv_blocks_used=s.get("kv_blocks_used", 0),
            waiting_tokens=s.get("waiting_tokens", 0),
            max_waiting_requests=self.limits.max_waiting_requests,
            max_waiting_tokens=self.limits.max_waiting_tokens,
            tokens_per_s=s.get("tokens_per_s", 0.0), requests_failed=self.streams.counts["failed"],
            active_request_ids=self.streams.ids(),
            aborted_request_ids=list(self.streams.aborted))

    def _announcement(self) -> Announcement:
        s = self.loop.stats() if self.loop else {}
        total = s.get("kv_blocks_total", 0) or 1
        return Announcement(service="engine", instance=self.instance, model=self.model_name,
                            max_model_len=self._engine.max_model_len if self._engine else None,
                            capabilities=self.capabilities,
                            running=s.get("running", 0), waiting=s.get("waiting", 0),
                            kv_usage=s.get("kv_blocks_used", 0) / total,
                            waiting_tokens=s.get("waiting_tokens", 0),
                            max_waiting_requests=self.limits.max_waiting_requests,
                            max_waiting_tokens=self.limits.max_waiting_tokens,
                            tokens_per_s=s.get("tokens_per_s", 0.0))

    async def _health(self) -> dict[str, Any]:
        return self._engine_stats().model_dump()

    def _heartbeat_age(self) -> float | None:
        """Seconds since the step loop last went round (loop.py: it beats while idle too)."""
        beat = self.loop.stats().get("heartbeat") if self.loop else None
        return None if beat is None else max(0.0, time.monotonic() - beat)


def _invalid(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, 400, "invalid_request_error", param=param)


