"""The tokenizer service on the real NATS server (loopback) with the real SmolLM2 tokenizer,
between a test gateway (this file) and a scripted fake engine."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import (
    Announcement,
    Cancel,
    ErrorInfo,
    Ping,
    RenderReply,
    SamplingOptions,
    TextFrame,
)
from flotilla.services.tokenizer.lanes import Lane
from flotilla.services.tokenizer.service import TokenizerService
from flotilla.services.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.fake_engine import FakeEngine, Script
from tests.tokenizer.harness import HELLO, gateway, request, settings_for
from tests.tracing import memory_exporter


async def test_chat_stream_end_to_end(bus: Bus, service: TokenizerService, engine: FakeEngine,
                                      smollm2: Tokenizer, hf_reference) -> None:
    reply = "Hello! 🤖 Ça va? 日本語"
    ids = smollm2.encode(reply, add_special_tokens=False)
    im_end = smollm2.encode("<|im_end|>", add_special_tokens=False)
    engine.script = Script(chunks=[[i] for i in ids] + [im_end])
    out = await gateway(bus, service.model, request(sampling=SamplingOptions(logprobs=2)))
    assert out.admission.accepted and out.error is None
    expected_prompt = hf_reference.apply_chat_template(HELLO, tokenize=True,
                                                       add_generation_prompt=True)["input_ids"]
    sent = engine.requests[-1]
    assert sent.prompt_token_ids == list(expected_prompt)
    assert out.admission.prompt_tokens == len(expected_prompt)
    assert sent.sampling.max_tokens is None  # the engine resolves it (libs/common/context.py)
    assert im_end[0] in sent.sampling.stop_token_ids
    assert out.text == reply
    assert all("\ufffd" not in f.data.text for f in out.frames if f.data)
    final = out.frames[-1].final
    assert final is not None and final.finish_reason == "stop"
    assert final.usage.prompt_tokens == len(expected_prompt)
    assert final.usage.completion_tokens == len(ids) + 1
    logprobs = [lp for f in out.frames if f.data and f.data.logprobs for lp in f.data.logprobs]
    assert [lp.token for lp in logprobs] == [smollm2.token_text(i) for i in ids]
    assert bytes(b for lp in logprobs for b in lp.bytes or []) == reply.encode()
    assert logprobs[0].top[1] == (smollm2.token_text(ids[0] + 1), -2.0)


async def test_completion_echo_and_length(bus: Bus, service: TokenizerService,
                                          engine: FakeEngine, smollm2: Tokenizer) -> None:
    engine.script = Script(chunks=[smollm2.encode(" a dragon", add_special_tokens=False)],
                           finish="length")
    out = await gateway(bus, service.model, request(
        "completion", prompt="Once upon a time", echo=True,
        sampling=SamplingOptions(max_tokens=2)))
    assert out.text == "Once upon a time a dragon"
    assert out.frames[-1].final.finish_reason == "length"
    assert engine.requests[-1].sampling.max_tokens == 2


async def test_stop_string_across_tokens_cancels_the_engine(
        bus: Bus, service: TokenizerService, engine: FakeEngine, smollm2: Tokenizer) -> None:
    text = "The capital of France is Paris. It is lovely. " * 5
    engine.script = Script(chunks=[[i] for i in smollm2.encode(text, add_special_tokens=False)],
                           chunk_delay=0.01)
    req = request(stop=["Paris. It"])
    out = await gateway(bus, service.model, req)
    assert out.text == "The capital of France is "
    final = out.frames[-1].final
    assert final is not None and final.finish_reason == "stop"
    for _ in range(100):
        if engine.finished.get(req.request_id):
            break
        await asyncio.sleep(0.02)
    assert any(c.request_id == req.request_id and c.reason == "stop_string"
               for c in engine.cancels)
    assert engine.finished[req.request_id] == "cancelled"


async def test_engine_error_frame_reaches_the_gateway(bus: Bus, service: TokenizerService,
                                                      engine: FakeEngine) -> None:
    engine.script = Script(chunks=[[28]], error=ErrorInfo(status=500, message="engine exploded",
                                                          code="internal_error"))
    out = await gateway(bus, service.model, request())
    assert out.error is not None
    assert out.error.status == 500 and out.error.info.message == "engine exploded"


async def test_dead_engine_is_a_503_not_a_hang(bus: Bus, service: TokenizerService,
                                               engine: FakeEngine) -> None:
    engine.script = Script(chunks=[[28]], silent=True)
    start = time.monotonic()
    out = await gateway(bus, service.model, request(), timeout=3.0)
    assert out.error is not None and out.error.status == 503
    assert time.monotonic() - start < 2.0  # the tokenizer's 0.5 s liveness timeout, not ours


async def test_long_prefill_is_kept_alive_by_heartbeats(bus: Bus, service: TokenizerService,
                                                        engine: FakeEngine,
                                                        smollm2: Tokenizer) -> None:
    """1.5 s of silence from the engine, 3x every timeout on the way: heartbeats carry it."""
    engine.script = Script(chunks=[smollm2.encode("late", add_special_tokens=False)],
                           first_delay=1.5)
    out = await gateway(bus, service.model, request(), timeout=0.5)
    assert out.error is None and out.text == "late"
    assert any(f.kind == "final" for f in out.frames)


async def test_engine_refusal_and_no_engine(bus: Bus, service: TokenizerService) -> None:
    out = await gateway(bus, service.model, request())
    assert not out.admission.accepted and out.admission.error.status == 503
    fake = FakeEngine(bus, service.model, Script(refuse=ErrorInfo(status=429, message="full")))
    await fake.start()
    try:
        out = await gateway(bus, service.model, request())
    finally:
        await fake.stop()
    assert not out.admission.accepted
    assert (out.admission.error.status, out.admission.error.message) == (429, "full")


async def test_context_length_is_refused_before_the_engine(
        bus: Bus, service: TokenizerService, engine: FakeEngine) -> None:
    out = await gateway(bus, service.model, request(sampling=SamplingOptions(max_tokens=9000)))
    err = out.admission.error
    assert not out.admission.accepted and err is not None
    assert (err.status, err.code) == (400, "context_length_exceeded")
    assert "8192" in err.message and "9000" in err.message
    assert engine.requests == []


async def test_gateway_cancel_drops_the_request(bus: Bus, service: TokenizerService,
                                                engine: FakeEngine, smollm2: Tokenizer) -> None:
    engine.script = Script(chunks=[[i] for i in smollm2.encode("word " * 200)], chunk_delay=0.02)
    req = request()

    async def cancel_after_first(frame: TextFrame) -> bool:
        if frame.kind == "data":
            await bus.publish(subjects.CANCEL,
                              Cancel(request_id=req.request_id, reason="client_disconnect"))
            return True
        return False

    out = await gateway(bus, service.model, req, on_frame=cancel_after_first)
    assert out.admission.accepted
    for _ in range(100):
        if not service._active and engine.finished.get(req.request_id):
            break
        await asyncio.sleep(0.02)
    assert req.request_id not in service._active
    assert engine.finished[req.request_id] == "cancelled"


async def test_render_reply(bus: Bus, service: TokenizerService, hf_reference) -> None:
    req = request().model_copy(update={"model": service.model})
    reply = await bus.request(subjects.tokenizer_render(service.model), req, RenderReply, 5.0)
    assert reply.error is None and reply.max_model_len == 8192
    assert reply.prompt == hf_reference.apply_chat_template(HELLO, tokenize=False,
                                                            add_generation_prompt=True)
    bad = request(messages=[{"role": "robot", "content": "x"}])
    reply = await bus.request(subjects.tokenizer_render(service.model), bad, RenderReply, 5.0)
    assert reply.error is not None and reply.error.param == "messages[0].role"


async def test_endless_template_override_fails_fast_and_service_keeps_serving(
        bus: Bus, smollm2_path: Path, smollm2: Tokenizer, tmp_path: Path) -> None:
    template = tmp_path / "loop.jinja"
    template.write_text("{% for i in range(100000) %}{% for j in range(100000) %}"
                        "{{ j }}{% endfor %}{% endfor %}")
    svc = TokenizerService(settings_for(smollm2_path, chat_template=template), bus, smollm2)
    await svc.start()
    fake = FakeEngine(bus, svc.model, Script(chunks=[[28]]))
    await fake.start()
    try:
        start = time.monotonic()
        out = await gateway(bus, svc.model, request())
        assert time.monotonic() - start < 1.5
        assert not out.admission.accepted
        # a budget overrun is overload (retry later), never a 400 that clients do not retry
        error = out.admission.error
        assert error.status == 503 and error.retry_after_s and error.retry_after_s >= 1
        assert "budget" in error.message
        out = await gateway(bus, svc.model, request("completion", prompt="still here"))
        assert out.admission.accepted and out.frames[-1].kind == "final"
    finally:
        await fake.stop()
        await svc.stop()


async def test_announces_model_and_context_length(bus: Bus, service: TokenizerService) -> None:
    seen: asyncio.Queue[Announcement] = asyncio.Queue()

    async def on_announce(msg: Announcement) -> None:
        if msg.model == service.model:
            await seen.put(msg)

    sub = await bus.subscribe(subjects.DISCOVERY_ANNOUNCE, Announcement, on_announce)
    await bus.publish(subjects.DISCOVERY_PING, Ping())
    msg = await asyncio.wait_for(seen.get(), 2.0)
    await sub.unsubscribe()
    assert (msg.service, msg.max_model_len) == ("tokenizer", 8192)


async def test_the_engines_published_context_length_wins(bus: Bus, service: TokenizerService,
                                                          engine: FakeEngine) -> None:
    """An engine whose KV cache holds fewer tokens than the model's context publishes that
    length: the tokenizer checks requests against it and announces it (for /v1/models)."""
    seen: asyncio.Queue[Announcement] = asyncio.Queue()

    async def on_announce(msg: Announcement) -> None:
        if msg.model == service.model and msg.service == "tokenizer":
            await seen.put(msg)

    sub = await bus.subscribe(subjects.DISCOVERY_ANNOUNCE, Announcement, on_announce)
    await bus.publish(subjects.DISCOVERY_ANNOUNCE, Announcement(
        service="engine", instance="engine-small", model=service.model, max_model_len=100))
    await bus.publish(subjects.DISCOVERY_ANNOUNCE, Announcement(  # another model's: ignored
        service="engine", instance="engine-other", model="other", max_model_len=50))
    await bus.publish(subjects.DISCOVERY_PING, Ping())
    msg = await asyncio.wait_for(seen.get(), 2.0)
    while msg.max_model_len != 100:
        msg = await asyncio.wait_for(seen.get(), 2.0)
    await sub.unsubscribe()
    out = await gateway(bus, service.model, request(sampling=SamplingOptions(max_tokens=95)))
    err = out.admission.error
    assert err is not None and (err.code, err.param) == ("context_length_exceeded", "max_tokens")
    assert "maximum context length is 100 tokens" in err.message
    assert engine.requests == []
    unset = await gateway(bus, service.model, request())
    assert unset.admission.accepted and engine.requests[-1].sampling.max_tokens is None


async def test_trace_joins_gateway_tokenizer_and_engine(bus: Bus, service: TokenizerService,
                                                        engine: FakeEngine,
                                                        smollm2: Tokenizer) -> None:
    exporter = memory_exporter()
    engine.script = Script(chunks=[smollm2.encode("ok", add_special_tokens=False)])
    with trace.get_tracer("test-gateway").start_as_current_span("gateway.request") as root:
        out = await gateway(bus, service.model, request())
    assert out.error is None
    await asyncio.sleep(0.05)
    spans = [s for s in exporter.get_finished_spans() if s.name == "tokenizer.generate"]
    assert len(spans) == 1
    span = spans[0]
    assert span.context.trace_id == root.get_span_context().trace_id
    assert span.parent is not None and span.parent.span_id == root.get_span_context().span_id
    assert engine.parent_spans[-1].span_id == span.context.span_id


async def test_tool_calls_stream_back_with_their_finish_reason(
        bus: Bus, service: TokenizerService, engine: FakeEngine, smollm2: Tokenizer) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    reply = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    engine.script = Script(chunks=[[i] for i in smollm2.encode(reply, False)]
                           + [smollm2.encode("<|im_end|>", False)])
    out = await gateway(bus, service.model, request(tools=[tool]))
    assert '"name": "get_weather"' in smollm2.decode(engine.requests[-1].prompt_token_ids)
    calls = [c for f in out.frames if f.data for c in f.data.tool_calls]
    assert calls[0].name == "get_weather" and calls[0].id
    assert {c.index for c in calls} == {0}  # the id and name, then argument fragments
    assert "".join(c.arguments for c in calls) == '{"city": "Oslo"}'
    assert out.text == "Checking."
    assert out.frames[-1].final.finish_reason == "tool_calls"


async def test_short_completion_prompts_are_tokenized_on_the_event_loop(
        bus: Bus, service: TokenizerService, engine: FakeEngine, smollm2: Tokenizer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A short completion prompt skips the worker thread (a hop that costs more than the
    tokenization); chat templates, long prompts and response formats still take it; the
    tokens and the errors are the same either way."""
    hops: list[str] = []
    run = Lane.run

    async def counting(lane: Lane, *args: Any, **kw: Any) -> Any:
        hops.append(lane.name)
        return await run(lane, *args, **kw)

    monkeypatch.setattr(Lane, "run", counting)
    short = "Once upon a time"
    out = await gateway(bus, service.model, request("completion", prompt=short,
                                                    sampling=SamplingOptions(max_tokens=2)))
    assert out.admission.accepted and hops == []
    assert engine.requests[-1].prompt_token_ids == smollm2.encode(short, add_special_tokens=True)
    ids = await gateway(bus, service.model, request("completion", prompt=[1, 2, 3]))
    assert ids.admission.accepted and hops == []
    empty = await gateway(bus, service.model, request("completion", prompt=""))
    assert empty.admission.error is not None and empty.admission.error.status == 400
    bad = await gateway(bus, service.model, request("completion", prompt=[10 ** 9]))
    assert bad.admission.error is not None and bad.admission.error.status == 400
    assert hops == ["light"]  # the empty prompt: not inline (0 < len)
    long = "x " * service.settings.inline_prepare_chars
    await gateway(bus, service.model, request("completion", prompt=long,
                                              sampling=SamplingOptions(max_tokens=2)))
    await gateway(bus, service.model, request("completion", prompt=short,
                                              response_format={"type": "json_object"}))
    await gateway(bus, service.model, request("chat"))
    assert hops == ["light", "light", "light", "grammar", "light"]
