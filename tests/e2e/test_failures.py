"""Client disconnects and engine deaths: work is cancelled, clients get errors, never hangs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import HealthReply, HealthRequest
from tests.e2e.conftest import MODEL

LONG = {"model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a cat."}],
        "max_tokens": 400, "temperature": 0.7, "seed": 1, "stream": True}


def _engine_stats(suite) -> dict:
    async def ask() -> dict:
        bus = await Bus.connect(suite.nats_url, "e2e-test", security=suite.nats_security)
        try:
            reply = await bus.request(subjects.health("engine"), HealthRequest(), HealthReply, 5)
            return reply.detail
        finally:
            await bus.close()

    return asyncio.run(ask())


def test_client_disconnect_cancels_engine_work(suite, client) -> None:
    other: dict = {}

    def run_other() -> None:  # an unrelated request in flight at the same time
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
            temperature=0, max_tokens=32)
        other["text"] = r.choices[0].message.content

    t = threading.Thread(target=run_other)
    t.start()
    with httpx.Client(base_url=suite.root_url, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json=LONG) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rid = json.loads(first[6:])["id"].removeprefix("chatcmpl-")
            for _ in range(3):
                next(lines)
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    stats = {}
    while time.monotonic() < deadline:
        stats = _engine_stats(suite)
        if f"{rid}-0" in stats["aborted_request_ids"]:
            break
        time.sleep(0.2)
    assert f"{rid}-0" in stats["aborted_request_ids"], stats
    assert f"{rid}-0" not in stats["active_request_ids"]
    t.join(60)
    assert other.get("text"), "the unrelated request did not complete"


def test_engine_killed_mid_stream(suite, http) -> None:
    state = suite.wait_ready(120)
    engine_pid = state["pids"]["engine"]
    events: list[str] = []
    with httpx.Client(base_url=suite.root_url, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json=LONG) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 3:
                    break
            os.kill(engine_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
            ended_after = time.monotonic() - killed_at
    assert ended_after < 5.0, f"stream took {ended_after:.1f}s to end after the engine died"
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])
    assert "error" in err and err["error"]["message"]
    # The launcher restarts the engine; the next request succeeds.
    suite.wait_ready(300, changed_pid=("engine", engine_pid))
    deadline = time.monotonic() + 60
    while True:
        r = http.post("/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 8})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
