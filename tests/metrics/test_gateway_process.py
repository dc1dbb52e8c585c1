"""The gateway as a real process (`python -m flotilla.services.gateway`): graceful drain on
SIGTERM, and
/metrics summed over several worker processes.

The fake tokenizer (tests/gateway/fakes.py) runs in this process on the test NATS; its "paced"
streams last ~4 s, longer than the grace a stopping server gives open streams (2 s), so only
a drain lets them finish.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx
import pytest

from flotilla.libs.common.bus import Bus
from tests.endpoints import NATS_URL
from tests.gateway.fakes import FakeTokenizer
from tests.metrics.scrape import Scrape, free_port

DRAIN_TIMEOUT_S = 10.0
PACED_WORDS = 40  # ~4 s: longer than the 2 s a stopping server gives open streams


@pytest.fixture
async def fake() -> AsyncIterator[FakeTokenizer]:
    bus = await Bus.connect(NATS_URL, "drain-test")
    tokenizer = FakeTokenizer(bus, f"drain-{uuid.uuid4().hex[:8]}")
    await tokenizer.start()
    yield tokenizer
    await tokenizer.stop()
    await bus.close()


@contextmanager
def gateway_process(port: int, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    environ = {**os.environ, "FLOTILLA_NATS_URL": NATS_URL, "FLOTILLA_PORT": str(port),
               "FLOTILLA_HOST": "127.0.0.1", "FLOTILLA_LOG_LEVEL": "WARNING",
               "FLOTILLA_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S), "FLOTILLA_GC_FREEZE": "0",
               **env}
    environ.pop("FLOTILLA_REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "flotilla.services.gateway"], env=environ)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def wait_serving(base: str, model: str, connections: int = 1) -> None:
    """Until `connections` new connections in a row (each may reach another worker) list
    `model`."""
    listed = 0
    for _ in range(400):
        try:
            async with httpx.AsyncClient(base_url=base, timeout=5) as http:
                r = await http.get("/v1/models")
            listed = listed + 1 if any(m["id"] == model for m in r.json()["data"]) else 0
            if listed == connections:
                return
        except httpx.TransportError:
            listed = 0
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway did not start serving the fake model")


def chat(model: str, content: str, stream: bool = False) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}


async def test_sigterm_drains_open_streams_and_refuses_new_ones(fake: FakeTokenizer) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with gateway_process(port) as proc:
        await wait_serving(base, fake.model)
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            started = asyncio.Event()
            first_chunks = 0

            async def stream() -> list[str]:
                nonlocal first_chunks
                words = []
                async with httpx.AsyncClient(base_url=base, timeout=30) as own:  # own connection
                    async with own.stream("POST", "/v1/chat/completions",
                                          json=chat(fake.model, "paced", stream=True)) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: {") and '"w' in line:
                                if not words:
                                    first_chunks += 1
                                    if first_chunks == 8:
                                        started.set()
                                words.append(line)
                            if line == "data: [DONE]":
                                words.append(line)
                return words

            streams = [asyncio.ensure_future(stream()) for _ in range(8)]
            await asyncio.wait_for(started.wait(), 10)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.2)
            refused = await http.post("/v1/chat/completions", json=chat(fake.model, "quick"))
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "draining"
            assert float(refused.headers["retry-after"]) > 0
            ready = await http.get("/ready")
            assert ready.status_code == 503
            assert any("draining" in r for r in ready.json()["reasons"])
            results = await asyncio.gather(*streams)
            for words in results:  # every stream finished whole
                assert words[-1] == "data: [DONE]"
                assert len(words) - 1 == PACED_WORDS
        code = await asyncio.to_thread(proc.wait, DRAIN_TIMEOUT_S)
        took = time.monotonic() - signalled
    assert code == 0
    assert took < DRAIN_TIMEOUT_S  # it left once the streams were done, not at the timeout


async def test_metrics_sum_over_gateway_workers(fake: FakeTokenizer) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    requests = 12
    with gateway_process(port, FLOTILLA_GATEWAY_WORKERS="2") as proc:
        await wait_serving(base, fake.model, connections=8)

        async def one() -> int:
            async with httpx.AsyncClient(base_url=base, timeout=30) as own:  # own connection:
                r = await own.post("/v1/chat/completions",  # spread over the workers
                                   json=chat(fake.model, "quick"))
                return r.status_code

        assert await asyncio.gather(*(one() for _ in range(requests))) == [200] * requests
        for _ in range(6):  # whichever worker answers the scrape shows both workers' counts
            async with httpx.AsyncClient(base_url=base, timeout=30) as own:
                scrape = Scrape((await own.get("/metrics")).text)
            assert scrape.value("flotilla:http_requests_total", endpoint="/v1/chat/completions",
                                status="200") == requests
            assert scrape.value("flotilla:request_success_total", model_name=fake.model,
                                finished_reason="stop") == requests
            assert scrape.value("flotilla:request_prompt_tokens_sum",
                                model_name=fake.model) == 7 * requests
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, DRAIN_TIMEOUT_S) == 0
