"""One client's heavy requests cannot hurt anyone else's (issue 19): through the tokenizer service
on the real NATS server, with the real SmolLM2 tokenizer and a scripted engine.

Before the lanes, 500-tool requests with tool_choice "required" at 2 requests/s made 26 of 30
ordinary chats fail with a 400 "rendering the chat template took longer than its budget": the
budget was wall-clock time in a shared thread pool, queue included."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import SamplingOptions
from flotilla.services.tokenizer.lanes import Lane
from flotilla.services.tokenizer.service import TokenizerService
from flotilla.services.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.fake_engine import FakeEngine, Script
from tests.tokenizer.harness import Outcome, gateway, request, settings_for


def tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Does thing number {i} with great care",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
            "unit": {"enum": ["c", "f"]}}}}}


TOOLS_500 = [tool(i) for i in range(500)]


def big_schema(seed: int) -> dict[str, Any]:
    """A schema of its own per request (no cache hit), large enough to cost a grammar check."""
    return {"type": "object", "properties": {
        f"field_{seed}_{i}": {"type": "string", "maxLength": 8} for i in range(150)}}


async def start(bus: Bus, path: Path, tok: Tokenizer, **kw: Any
                ) -> tuple[TokenizerService, FakeEngine]:
    svc = TokenizerService(settings_for(path, **kw), bus, tok)
    await svc.start()
    engine = FakeEngine(bus, svc.model, Script(chunks=[[28]]))
    await engine.start()
    return svc, engine


@pytest.mark.slow
async def test_a_flood_of_heavy_requests_leaves_ordinary_chats_alone(
        bus: Bus, smollm2_path: Path, smollm2: Tokenizer) -> None:
    svc, engine = await start(bus, smollm2_path, smollm2, max_tools=1000)
    heavy: list[Outcome] = []
    ordinary: list[tuple[float, Outcome]] = []
    stop = asyncio.Event()

    async def flood() -> None:
        n = 0
        tasks = []
        while not stop.is_set():  # 8 heavy requests a second, half of each kind
            n += 1
            if n % 2:
                req = request(tools=TOOLS_500, tool_choice="required")
            else:
                req = request(response_format={"type": "json_schema", "json_schema": {
                    "name": "big", "schema": big_schema(n)}})
            tasks.append(asyncio.ensure_future(gateway(bus, svc.model, req, timeout=2.0)))
            await asyncio.sleep(0.125)
        heavy.extend(await asyncio.gather(*tasks))

    async def chat(i: int) -> None:
        start_at = time.monotonic()
        out = await gateway(bus, svc.model, request(
            messages=[{"role": "user", "content": f"Hello number {i}"}],
            sampling=SamplingOptions(max_tokens=4)))
        ordinary.append((time.monotonic() - start_at, out))

    try:
        flooding = asyncio.ensure_future(flood())
        await asyncio.sleep(1.0)  # the flood is on
        chats = []
        for i in range(30):
            chats.append(asyncio.ensure_future(chat(i)))
            await asyncio.sleep(0.2)
        await asyncio.gather(*chats)
        stop.set()
        await flooding
    finally:
        await engine.stop()
        await svc.stop()
    took = sorted(t for t, _ in ordinary)
    print(f"ordinary chats during the flood: p50 {statistics.median(took) * 1000:.0f} ms, "
          f"max {took[-1] * 1000:.0f} ms; heavy: "
          f"{sum(o.admission.accepted for o in heavy)} admitted, "
          f"{sum((o.admission.error or 0) and o.admission.error.status == 503 for o in heavy)} "
          f"503 of {len(heavy)}")
    for _, out in ordinary:
        assert out.admission.accepted, out.admission.error
        assert out.error is None and out.frames[-1].kind == "final"
    assert took[-1] < 3.0  # each ordinary chat admitted and answered within a bound
    for out in heavy:  # the heavy ones: served, refused for size, or told to retry, never stuck
        error = out.admission.error
        assert out.admission.accepted or (error is not None and (
            error.status == 400 and error.code == "context_length_exceeded"
            or error.status == 503 and (error.retry_after_s or 0) >= 1)), error


async def test_cost_caps_are_400s_naming_the_parameter(
        bus: Bus, smollm2_path: Path, smollm2: Tokenizer) -> None:
    svc, engine = await start(bus, smollm2_path, smollm2, max_tools=8, max_tools_chars=4_000,
                              max_prompt_chars=1_000)
    try:
        cases = [
            (request(tools=[tool(i) for i in range(9)]), "tools"),
            (request(tools=[{**tool(0), "function": {**tool(0)["function"],
                                                     "description": "x" * 5_000}}]), "tools"),
            (request(messages=[{"role": "user", "content": "y" * 2_000}]), "messages"),
            (request("completion", prompt="z" * 2_000), "prompt"),
            # within the caps before the template, over them after (the tools' descriptions)
            (request(tools=[tool(i) for i in range(8)]), "messages"),
        ]
        for req, param in cases:
            out = await gateway(bus, svc.model, req)
            error = out.admission.error
            assert error is not None and error.status == 400 and error.param == param, error
        ok = await gateway(bus, svc.model, request(tools=[tool(0)]))
        assert ok.admission.accepted
    finally:
        await engine.stop()
        await svc.stop()


async def test_a_full_heavy_lane_is_a_503_with_retry_after_and_spares_the_light_one(
        bus: Bus, smollm2_path: Path, smollm2: Tokenizer) -> None:
    svc, engine = await start(bus, smollm2_path, smollm2, max_tools=1000, heavy_queue_size=0)
    try:
        burst = [gateway(bus, svc.model, request(tools=TOOLS_500, tool_choice="required"))
                 for _ in range(6)]
        chat = gateway(bus, svc.model, request())
        *heavy, light = await asyncio.gather(*burst, chat)
        statuses = sorted(o.admission.error.status for o in heavy if o.admission.error)
        assert 503 in statuses and set(statuses) <= {400, 503}, statuses
        for out in heavy:
            if out.admission.error and out.admission.error.status == 503:
                assert (out.admission.error.retry_after_s or 0) >= 1
        assert light.admission.accepted
    finally:
        await engine.stop()
        await svc.stop()


async def test_deadlines_and_priority(bus: Bus, smollm2_path: Path, smollm2: Tokenizer,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    svc, engine = await start(bus, smollm2_path, smollm2)
    try:
        deadline = time.time() + 30
        out = await gateway(bus, svc.model, request(priority=3, deadline=deadline))
        assert out.admission.accepted
        assert engine.requests[-1].priority == 3 and engine.requests[-1].deadline == deadline
        seen = len(engine.requests)
        past = await gateway(bus, svc.model, request(deadline=time.time() - 1))
        error = past.admission.error
        assert error is not None and error.status == 504 and error.code == "deadline_exceeded"

        run = Lane.run  # a deadline that passes while the request waits for a thread

        async def slow(lane: Lane, fn: Any, *args: Any, **kw: Any) -> Any:
            await asyncio.sleep(0.3)
            return await run(lane, fn, *args, **kw)

        monkeypatch.setattr(Lane, "run", slow)
        queued = await gateway(bus, svc.model, request(deadline=time.time() + 0.1))
        error = queued.admission.error
        assert error is not None and error.status == 504 and error.code == "deadline_exceeded"
        assert len(engine.requests) == seen  # neither reached the engine
    finally:
        await engine.stop()
        await svc.stop()


async def test_checked_grammars_are_remembered(bus: Bus, smollm2_path: Path,
                                               smollm2: Tokenizer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tools or schema again (every turn of an agent) skip the grammar lane; the
    cache stays within its bound."""
    svc, engine = await start(bus, smollm2_path, smollm2, grammar_cache_size=2)
    hops: list[str] = []
    run = Lane.run

    async def counting(lane: Lane, *args: Any, **kw: Any) -> Any:
        hops.append(lane.name)
        return await run(lane, *args, **kw)

    monkeypatch.setattr(Lane, "run", counting)
    try:
        schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": big_schema(1)}}
        for _ in range(3):
            out = await gateway(bus, svc.model, request(response_format=schema))
            assert out.admission.accepted
        assert hops.count("grammar") == 1
        bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"not": {}}}}
        for _ in range(2):  # a refusal is remembered too
            out = await gateway(bus, svc.model, request(response_format=bad))
            assert out.admission.error is not None and out.admission.error.status == 400
        assert hops.count("grammar") == 2
        for i in range(5):
            await gateway(bus, svc.model, request(response_format={
                "type": "regex", "regex": f"a{{{i + 1}}}"}))
        assert svc.preparer is not None and len(svc.preparer.specs) == 2
    finally:
        await engine.stop()
        await svc.stop()



async def test_a_burst_of_one_schema_is_checked_once(bus: Bus, smollm2_path: Path,
                                                     smollm2: Tokenizer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent requests with one new schema (a client's parallel samples) share one
    grammar check instead of filling the grammar queue (they got 503s before)."""
    svc, engine = await start(bus, smollm2_path, smollm2, grammar_queue_size=0)
    hops: list[str] = []
    run = Lane.run

    async def counting(lane: Lane, *args: Any, **kw: Any) -> Any:
        hops.append(lane.name)
        return await run(lane, *args, **kw)

    monkeypatch.setattr(Lane, "run", counting)
    try:
        schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": big_schema(7)}}
        outs = await asyncio.gather(*(gateway(bus, svc.model, request(response_format=schema))
                                      for _ in range(20)))
        assert all(o.admission.accepted for o in outs), [o.admission.error for o in outs]
        assert hops.count("grammar") == 1
    finally:
        await engine.stop()
        await svc.stop()
