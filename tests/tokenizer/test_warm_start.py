"""No first-request penalty (issue 20): a freshly started tokenizer process (its own Python, so
nothing is imported yet) whose first requests are a `json_schema` one and a forced tool call
admits both at once, under the tight template budget that used to fail them (xgrammar was
imported lazily inside that budget: 3.5-5.5 s on a busy 2-core machine)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Announcement, SamplingOptions
from tests.endpoints import NATS_URL
from tests.tokenizer.fake_engine import FakeEngine, Script
from tests.tokenizer.harness import gateway, request

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
          "required": ["answer"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.slow
async def test_the_first_requests_of_a_fresh_process_are_structured_and_succeed(
        bus: Bus, smollm2_path: Path) -> None:
    model = f"warm-{uuid.uuid4().hex[:8]}"
    announced: asyncio.Queue[Announcement] = asyncio.Queue()

    async def on_announce(msg: Announcement) -> None:
        if msg.model == model:
            await announced.put(msg)

    sub = await bus.subscribe(subjects.DISCOVERY_ANNOUNCE, Announcement, on_announce)
    env = {**os.environ, "FLOTILLA_NATS_URL": NATS_URL, "FLOTILLA_MODEL": str(smollm2_path),
           "FLOTILLA_SERVED_MODEL_NAME": model, "FLOTILLA_TEMPLATE_TIMEOUT_S": "0.5",
           "FLOTILLA_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "flotilla.services.tokenizer"], env=env)
    engine = FakeEngine(bus, model, Script(chunks=[[28]]))
    await engine.start()
    try:
        await asyncio.wait_for(announced.get(), timeout=240)  # start-up, warm-up included
        for req in (
                request(response_format={"type": "json_schema",
                                         "json_schema": {"name": "a", "schema": SCHEMA}},
                        sampling=SamplingOptions(max_tokens=8)),
                request(tools=[TOOL], tool_choice="required",
                        sampling=SamplingOptions(max_tokens=8))):
            start = time.monotonic()
            out = await gateway(bus, model, req, timeout=5.0)
            assert out.admission.accepted, out.admission.error
            assert time.monotonic() - start < 5.0
            assert engine.requests[-1].sampling.guided is not None
    finally:
        await engine.stop()
        await sub.unsubscribe()
        proc.terminate()
        proc.wait(timeout=30)
