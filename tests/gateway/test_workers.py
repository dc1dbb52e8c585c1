"""Several gateway processes on one port (FLOTILLA_GATEWAY_WORKERS=2), run as the launcher runs the
gateway (`python -m flotilla.services.gateway`) against the package's fake tokenizer: connections
are spread over both workers, each serves streams and cancels on its own, and the parent stops,
fails and dies without leaving a worker behind. Who holds which connection is read from /proc,
not from the gateway."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Cancel
from flotilla.services.launcher.nats_server import free_port
from tests.gateway.conftest import NATS_URL, chat, decode_events, read_sse
from tests.gateway.fakes import FakeTokenizer
from tests.launcher.helpers import children, gone, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _start(port: int, workers: int = 2) -> subprocess.Popen[bytes]:
    env = dict(os.environ, FLOTILLA_NATS_URL=NATS_URL, FLOTILLA_HOST="127.0.0.1",
               FLOTILLA_PORT=str(port), FLOTILLA_GATEWAY_WORKERS=str(workers),
               FLOTILLA_LOG_LEVEL="WARNING", FLOTILLA_DISCOVERY_INTERVAL_S="0.5",
               FLOTILLA_OTEL_EXPORTER="none", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "flotilla.services.gateway"], env=env, cwd=ROOT)


def _established(pid: int, port: int) -> int:
    """Established TCP connections on local `port` whose socket `pid` holds (/proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":  # TCP_ESTABLISHED
                inodes.add(fields[9])
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            held += 1
    return held


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def parent(port: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = _start(port)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture
async def served(parent: subprocess.Popen[bytes], port: int,
                 tokenizer: FakeTokenizer) -> AsyncIterator[list[int]]:
    """The parent's worker pids, once both workers serve the fake model."""
    assert wait_until(lambda: len(children(parent.pid)) == 2, timeout=20)
    workers = sorted(children(parent.pid))
    close = {"Connection": "close"}  # a new connection each: either worker may answer
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        ok = 0
        for _ in range(400):
            try:
                answer = await http.get(f"/v1/models/{tokenizer.model}", headers=close)
                ok = ok + 1 if answer.status_code == 200 else 0
            except httpx.HTTPError:
                ok = 0
            if ok == 16:  # both workers know the model (odds of one unasked: 2^-16)
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the two gateway workers did not become ready")
    yield workers


async def test_connections_are_spread_over_the_workers(served: list[int], port: int,
                                                       model: str) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=15,
                                 limits=httpx.Limits(max_keepalive_connections=32)) as http:
        replies = await asyncio.gather(*(http.post("/v1/completions", json={
            "model": model, "prompt": f"hi {i}", "max_tokens": 4}) for i in range(32)))
        assert all(r.status_code == 200 for r in replies)
        assert {r.json()["choices"][0]["text"] for r in replies} == {"Hello world !"}
        held = [_established(pid, port) for pid in served]
    # 32 new connections, hashed over two sockets: all on one worker has odds of 2^-31.
    assert sum(held) >= 16 and min(held) >= 1, held


async def test_every_worker_streams_and_cancels_on_disconnect(served: list[int], port: int,
                                                              model: str, bus: Bus) -> None:
    seen: list[Cancel] = []

    async def on_cancel(msg: Cancel) -> None:
        seen.append(msg)

    sub = await bus.subscribe(subjects.CANCEL, Cancel, on_cancel)
    base = f"http://127.0.0.1:{port}"
    rids: list[str] = []
    used = set()
    for _ in range(12):  # one fresh connection each: both workers get some
        async with httpx.AsyncClient(base_url=base, timeout=10) as own:
            async with own.stream("POST", "/v1/chat/completions",
                                  json=chat(model, "hi", stream=True)) as r:
                assert r.status_code == 200
                events = decode_events(await read_sse(r))
            assert "".join(e["choices"][0]["delta"].get("content") or ""
                           for e in events if e["choices"]) == "Hello world !"
            async with own.stream("POST", "/v1/chat/completions",
                                  json=chat(model, "slow", stream=True)) as r:
                lines = r.aiter_lines()
                first = await anext(lines)
                rids.append(json.loads(first.removeprefix("data: "))["id"]
                            .removeprefix("chatcmpl-"))
                used.update(pid for pid in served if _established(pid, port))
            # Leaving the block closed the connection mid-stream: that worker cancels.
    assert len(used) == 2, "both workers should have held one of 12 connections"
    wanted = {f"{rid}-0" for rid in rids}
    for _ in range(100):
        if wanted <= {c.request_id for c in seen}:
            break
        await asyncio.sleep(0.05)
    assert wanted <= {c.request_id for c in seen}
    assert {c.reason for c in seen if c.request_id in wanted} == {"client_disconnect"}
    await sub.unsubscribe()


async def test_sigterm_stops_every_worker(served: list[int],
                                          parent: subprocess.Popen[bytes]) -> None:
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(15) == 0
    assert all(gone(pid) for pid in served)


async def test_a_dead_worker_stops_the_gateway(served: list[int],
                                               parent: subprocess.Popen[bytes]) -> None:
    os.kill(served[0], signal.SIGKILL)
    assert parent.wait(15) == 1  # its supervisor restarts the whole gateway
    assert all(gone(pid) for pid in served)


async def test_workers_die_with_a_sigkilled_parent(served: list[int],
                                                   parent: subprocess.Popen[bytes]) -> None:
    parent.kill()
    parent.wait(5)
    assert wait_until(lambda: all(gone(pid) for pid in served), timeout=5)
