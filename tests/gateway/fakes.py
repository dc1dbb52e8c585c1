"""Test doubles on the real bus: a tokenizer (plus an engine's announcement) for one model, and a
tools service. The tokenizer's behaviour is chosen by the last message (or the prompt):

- "refuse"      → Admission refused with 400 context_length_exceeded
- "quick"       → "ok" in one delta, stop (no pauses: for request floods)
- "busy"        → Admission refused with 503, retry_after_s 2.5 (an overloaded engine)
- "limited"     → Admission refused with 429, retry_after_s 0.2 (a per-client limit)
- "slow"        → one word every 0.1 s until cancelled (200 words at most)
- "paced"       → 40 words, one every 0.1 s (a stream of ~4 s), finish_reason length
- "die"         → one word, then silence (no frames, no heartbeats): a dead upstream
- "error"       → one word, then an error frame (503)
- "tools"       → a tool call (streamed in two pieces), finish_reason tool_calls
- "think"       → reasoning text, then content
- "json"        → `{"a": 1}`, stop
- anything else → "Hello world !" in three deltas (interleaving with sibling choices), stop;
  with `echo` or `sampling.prompt_logprobs` a first delta carries the prompt (echo) and its
  prompt logprobs (one per character: id = code point, logprob = -position/10, the first None)

Prompts are tokenized one character per token (id = code point; BOS = 1 with
`add_special_tokens`); /detokenize refuses ids of 0x110000 and above.
Embeddings (`tokenizer_embed`): each input's vector has EMBED_DIM values, value k the count of
its tokens (characters or ids) equal to k modulo EMBED_DIM, plus one, then L2-normalized;
`dimensions` above EMBED_DIM and ids of 0x110000 and above are 400s. Scores
(`tokenizer_score`): the dot product of the two texts' vectors.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import (
    Admission,
    Announcement,
    Cancel,
    DecodeReply,
    DecodeRequest,
    EncodeReply,
    EncodeRequest,
    ErrorInfo,
    RenderReply,
    TextDelta,
    TextFinal,
    TextFrame,
    TextLogprob,
    TextRequest,
    ToolCallDelta,
    Usage,
)
from flotilla.libs.common.pooling_messages import EmbedRequest, PoolReply, ScoreReply, ScoreRequest
from flotilla.libs.common.service import Announcer
from flotilla.libs.common.tool_messages import ToolsListReply, ToolsListRequest

HEARTBEAT_S = 0.1
BOS = 1
MAX_MODEL_LEN = 4096
EMBED_DIM = 8


def fake_embedding(item: str | list[int], dimensions: int | None = None) -> list[float]:
    ids = [ord(c) for c in item] if isinstance(item, str) else item
    vec = [1.0 + sum(1 for i in ids if i % EMBED_DIM == k) for k in range(EMBED_DIM)]
    vec = vec[:dimensions]
    norm = sum(v * v for v in vec) ** 0.5
    return [v / norm for v in vec]


def _scenario(req: TextRequest) -> str:
    if req.messages:
        content = req.messages[-1].get("content")
        return content if isinstance(content, str) else ""
    return req.prompt if isinstance(req.prompt, str) else ""


@dataclass
class FakeTokenizer:
    bus: Bus
    model: str
    requests: list[TextRequest] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)
    trace_ids: dict[str, int] = field(default_factory=dict)  # request id → trace it arrived in
    _subs: list[Any] = field(default_factory=list)
    _announcers: list[Announcer] = field(default_factory=list)

    async def start(self) -> None:
        self._subs.append(await self.bus.serve(subjects.tokenizer_generate(self.model),
                                               TextRequest, self._generate, queue="tokenizer"))
        self._subs.append(await self.bus.serve(subjects.tokenizer_render(self.model),
                                               TextRequest, self._render, queue="tokenizer"))
        self._subs.append(await self.bus.serve(subjects.tokenizer_encode(self.model),
                                               EncodeRequest, self._encode, queue="tokenizer"))
        self._subs.append(await self.bus.serve(subjects.tokenizer_embed(self.model),
                                               EmbedRequest, self._embed, queue="tokenizer"))
        self._subs.append(await self.bus.serve(subjects.tokenizer_score(self.model),
                                               ScoreRequest, self._score, queue="tokenizer"))
        self._subs.append(await self.bus.serve(subjects.tokenizer_decode(self.model),
                                               DecodeRequest, self._decode, queue="tokenizer"))
        self._subs.append(await self.bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel))
        for service in ("tokenizer", "engine"):
            ann = Announcement(service=service, instance=f"fake-{service}-{self.model}",  # type: ignore[arg-type]
                               model=self.model, max_model_len=MAX_MODEL_LEN)
            announcer = Announcer(self.bus, service, ann.instance, 0.5, make=ann.model_copy)
            await announcer.start()
            self._announcers.append(announcer)

    async def stop(self) -> None:
        for announcer in self._announcers:
            await announcer.stop()
        for sub in self._subs:
            await sub.unsubscribe()

    async def _on_cancel(self, cancel: Cancel) -> None:
        self.cancels.append(cancel)

    def cancelled(self, request_id: str) -> bool:
        return any(c.request_id == request_id for c in self.cancels)

    async def _render(self, req: TextRequest) -> RenderReply:
        if req.messages is not None:
            text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in req.messages)
            if req.add_generation_prompt:
                text += "<assistant>"
        else:
            text = req.prompt if isinstance(req.prompt, str) else ""
        return RenderReply(prompt=text, token_ids=[ord(c) for c in text],
                           max_model_len=MAX_MODEL_LEN)

    async def _encode(self, req: EncodeRequest) -> EncodeReply:
        ids = [BOS] * req.add_special_tokens + [ord(c) for c in req.text]
        strs = ["<s>" if i == BOS else chr(i) for i in ids] if req.token_strs else None
        return EncodeReply(token_ids=ids, token_strs=strs, max_model_len=MAX_MODEL_LEN)

    async def _embed(self, req: EmbedRequest) -> PoolReply:
        dims = req.pooling.dimensions
        if dims is not None and dims > EMBED_DIM:
            return PoolReply(error=ErrorInfo(status=400, type="invalid_request_error",
                                             param="dimensions", message="too many"))
        if any(isinstance(i, list) and any(t >= 0x110000 for t in i) for i in req.inputs):
            return PoolReply(error=ErrorInfo(status=400, type="invalid_request_error",
                                             param="input", message="id out of range"))
        vectors = [fake_embedding(i, dims) for i in req.inputs]
        return PoolReply(embeddings=[base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
                                     for v in vectors],
                         prompt_tokens=sum(len(i) for i in req.inputs))

    async def _score(self, req: ScoreRequest) -> ScoreReply:
        scores = [sum(a * b for a, b in zip(fake_embedding(q), fake_embedding(d), strict=True))
                  for q, d in zip(req.queries, req.documents, strict=True)]
        return ScoreReply(scores=scores, prompt_tokens=sum(map(len, req.queries + req.documents)))

    async def _decode(self, req: DecodeRequest) -> DecodeReply:
        if any(i >= 0x110000 for i in req.token_ids):
            return DecodeReply(error=ErrorInfo(status=400, type="invalid_request_error",
                                               param="tokens", message="id out of range"))
        # ids in the surrogate range read as U+FFFD, as a real tokenizer's invalid bytes do
        return DecodeReply(text="".join("\ufffd" if 0xD800 <= i < 0xE000 else chr(i)
                                        for i in req.token_ids))

    async def _generate(self, req: TextRequest) -> Admission:
        self.requests.append(req)
        self.trace_ids[req.request_id] = trace.get_current_span().get_span_context().trace_id
        scenario = _scenario(req)
        if scenario in ("busy", "limited"):
            status, retry = (503, 2.5) if scenario == "busy" else (429, 0.2)
            return Admission(request_id=req.request_id, accepted=False, error=ErrorInfo(
                status=status, type="service_unavailable", code="overloaded",
                message="the engine's queue is full", retry_after_s=retry))
        if scenario == "refuse":
            return Admission(request_id=req.request_id, accepted=False, error=ErrorInfo(
                status=400, type="invalid_request_error", param="messages",
                code="context_length_exceeded",
                message="This model's maximum context length is 4096 tokens."))
        writer = self.bus.writer(req.stream_subject, req.request_id, TextFrame, HEARTBEAT_S)
        self.bus.spawn(self._stream(req, scenario, writer))
        return Admission(request_id=req.request_id, accepted=True, instance="fake",
                         prompt_tokens=7)

    async def _stream(self, req: TextRequest, scenario: str, writer: Any) -> None:
        usage = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=2)
        logprobs = req.sampling.logprobs is not None
        if scenario == "slow":
            for i in range(200):
                if self.cancelled(req.request_id):
                    writer.close()
                    return
                await writer.data(TextDelta(text=f"w{i} "))
                await asyncio.sleep(0.1)
            await writer.final(TextFinal(finish_reason="length", usage=usage))
            return
        if scenario == "paced":
            for i in range(40):
                await writer.data(TextDelta(text=f"w{i} "))
                await asyncio.sleep(0.1)
            await writer.final(TextFinal(finish_reason="length", usage=usage))
            return
        if scenario in ("die", "error"):
            await writer.data(TextDelta(text="partial"))
            if scenario == "die":
                writer.close()
            else:
                await writer.error(ErrorInfo(status=503, type="service_unavailable",
                                             code="service_unavailable",
                                             message="the engine went away"))
            return
        if scenario == "tools":
            await writer.data(TextDelta(tool_calls=[ToolCallDelta(
                index=0, id="call_1", name="get_weather", arguments='{"city": ')]))
            await writer.data(TextDelta(tool_calls=[ToolCallDelta(index=0,
                                                                   arguments='"Paris"}')]))
            await writer.final(TextFinal(finish_reason="tool_calls", usage=usage))
            return
        if scenario == "json":
            await writer.data(TextDelta(text='{"a": 1}'))
            await writer.final(TextFinal(finish_reason="stop", usage=usage))
            return
        if scenario == "quick":
            await writer.data(TextDelta(text="ok"))
            await writer.final(TextFinal(finish_reason="stop", usage=usage))
            return
        if scenario == "stopseq":  # the text ended at the request's first stop string
            await writer.data(TextDelta(text="ok"))
            await writer.final(TextFinal(finish_reason="stop", usage=usage,
                                         stop_string=req.stop[0] if req.stop else None))
            return
        if scenario == "think":
            await writer.data(TextDelta(reasoning="Let me think."))
            await writer.data(TextDelta(text="42"))
            await writer.final(TextFinal(finish_reason="stop", usage=usage))
            return
        if req.echo or req.sampling.prompt_logprobs is not None:
            await writer.data(self._prompt_delta(req))
        for word in ("Hello", " world", " !"):
            lp = [TextLogprob(token=word, logprob=-0.5, top=[(word, -0.5), ("x", -2.0)])]
            await writer.data(TextDelta(text=word, logprobs=lp if logprobs else None))
            await asyncio.sleep(0.05)
        await writer.final(TextFinal(finish_reason="stop", usage=usage))


    @staticmethod
    def _prompt_delta(req: TextRequest) -> TextDelta:
        text = _scenario(req)
        k = req.sampling.prompt_logprobs
        entries: list[TextLogprob | None] | None = None
        if k is not None:
            entries = [None] + [
                TextLogprob(token=c, logprob=-i / 10, token_id=ord(c),
                            top=[(c, -i / 10), ("x", -9.0)][:k], top_ids=[ord(c), 120][:k])
                for i, c in enumerate(text[1:], 1)]
        return TextDelta(text=text if req.echo else "", prompt_logprobs=entries,
                         prompt_first_token=text[:1] if k is not None else "")


@dataclass
class FakeTools:
    bus: Bus
    tools: list[dict[str, Any]]
    calls: int = 0
    _sub: Any = None

    async def start(self) -> None:
        self._sub = await self.bus.serve(subjects.TOOLS_LIST, ToolsListRequest, self._list,
                                         queue="tools")
        # as the tools service: announce at start (a gateway drops its cached tool list)
        await self.bus.publish(subjects.DISCOVERY_ANNOUNCE, Announcement(
            service="tools", instance=f"tools-{uuid.uuid4().hex[:8]}"))
        await self.bus.nc.flush()
        await asyncio.sleep(0.05)  # delivered to the gateway's subscription on this connection

    async def stop(self) -> None:
        await self._sub.unsubscribe()

    async def _list(self, _: ToolsListRequest) -> ToolsListReply:
        self.calls += 1
        return ToolsListReply(tools=self.tools)
