"""A test double for the engine service: serves `engine_generate(model)` and streams scripted
token ids, so tokenizer tests control exactly what comes back (errors, silence, slow prefill)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from opentelemetry import trace

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import (
    Admission,
    Cancel,
    ErrorInfo,
    TokenDelta,
    TokenFinal,
    TokenFrame,
    TokenLogprob,
    TokenRequest,
)


@dataclass
class Script:
    chunks: list[list[int]] = field(default_factory=list)
    finish: str = "stop"
    first_delay: float = 0.0        # a long prefill: only heartbeats meanwhile
    chunk_delay: float = 0.0
    error: ErrorInfo | None = None  # sent after the chunks instead of a final
    silent: bool = False            # after the chunks: no final, no heartbeats (a dead engine)
    refuse: ErrorInfo | None = None


class FakeEngine:
    def __init__(self, bus: Bus, model: str, script: Script | None = None):
        self.bus, self.model = bus, model
        self.script = script or Script()
        self.requests: list[TokenRequest] = []
        self.cancels: list[Cancel] = []
        self.parent_spans: list[trace.SpanContext] = []
        self.finished: dict[str, str] = {}  # request id -> how its stream ended
        self._subs: list = []

    async def start(self) -> None:
        self._subs = [
            await self.bus.serve(subjects.engine_generate(self.model), TokenRequest, self._handle,
                                 queue="engine"),
            await self.bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel),
        ]

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

    def cancelled(self, rid: str) -> bool:
        return any(c.request_id == rid for c in self.cancels)

    async def _on_cancel(self, msg: Cancel) -> None:
        self.cancels.append(msg)

    async def _handle(self, req: TokenRequest) -> Admission:
        self.requests.append(req)
        self.parent_spans.append(trace.get_current_span().get_span_context())
        if self.script.refuse is not None:
            return Admission(request_id=req.request_id, accepted=False, error=self.script.refuse)
        self.bus.spawn(self._stream(req, self.script))
        return Admission(request_id=req.request_id, accepted=True, instance="fake-engine",
                         prompt_tokens=len(req.prompt_token_ids))

    async def _stream(self, req: TokenRequest, script: Script) -> None:
        rid = req.request_id
        writer = self.bus.writer(req.stream_subject, rid, TokenFrame, heartbeat_interval=0.05)
        await asyncio.sleep(script.first_delay)
        sent = 0
        prompt_logprobs = None
        if req.sampling.prompt_logprobs is not None:  # the first delta carries them
            prompt_logprobs = [None] + [TokenLogprob(token_id=t, logprob=-1.0 - i / 10,
                                                     top=[(t, -1.0 - i / 10)])
                                        for i, t in enumerate(req.prompt_token_ids[1:])]
        for chunk in script.chunks:
            if self.cancelled(rid):
                writer.close()
                self.finished[rid] = "cancelled"
                return
            logprobs = None
            if req.sampling.logprobs is not None:
                logprobs = [TokenLogprob(token_id=t, logprob=-0.5, top=[(t, -0.5), (t + 1, -2.0)])
                            for t in chunk]
            await writer.data(TokenDelta(token_ids=chunk, logprobs=logprobs,
                                         prompt_logprobs=prompt_logprobs))
            prompt_logprobs = None
            sent += len(chunk)
            await asyncio.sleep(script.chunk_delay)
        if script.silent:
            writer.close()
            self.finished[rid] = "silent"
        elif script.error is not None:
            await writer.error(script.error)
            self.finished[rid] = "error"
        else:
            await writer.final(TokenFinal(finish_reason=script.finish,  # type: ignore[arg-type]
                                          prompt_tokens=len(req.prompt_token_ids),
                                          completion_tokens=sent))
            self.finished[rid] = "final"
