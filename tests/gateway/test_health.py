"""/health is liveness (this process and its NATS connection), /ready is readiness (NATS, the
store, and every hop of every served model answering its own probe, the engine with a fresh
step-loop heartbeat). Real NATS; each test has its own registry and announcers."""

from __future__ import annotations

import asyncio
import functools
import logging
import subprocess
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml
from jsonschema import Draft202012Validator

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Announcement, HealthRequest
from flotilla.libs.common.service import Announcer
from flotilla.libs.common.store import MemoryStore, RedisStore, Store
from flotilla.services.gateway.app import create_app
from flotilla.services.gateway.registry import ModelRegistry
from flotilla.services.launcher.nats_server import free_port
from tests.endpoints import NATS_URL
from tests.gateway.conftest import gateway_settings
from tests.gateway.schemas import OUR_SPEC, validate_openai

PROBE_S = 0.3


@functools.cache
def _schema(path: str, status: str) -> Draft202012Validator:
    document = yaml.safe_load(OUR_SPEC.read_text())
    response = document["paths"][path]["get"]["responses"][status]
    schema = response["content"]["application/json"]["schema"]
    return Draft202012Validator({**schema, "components": document["components"]})


def check_ready_body(r: httpx.Response) -> dict[str, Any]:
    """The /ready answer as the spec describes it (either status), with Retry-After on 503."""
    assert r.status_code in (200, 503), r.text
    errors = [e.message for e in _schema("/ready", str(r.status_code)).iter_errors(r.json())]
    assert not errors, errors
    body: dict[str, Any] = r.json()
    assert (body["status"] == "ready") == (r.status_code == 200) == (not body["reasons"])
    if r.status_code == 503:
        assert int(r.headers["retry-after"]) >= 1
    return body


@asynccontextmanager
async def gateway_client(bus: Bus, store: Store, **settings: Any) -> AsyncIterator[Gateway]:
    """A gateway app (not started: its registry learns only what a test records) and a client."""
    app = create_app(gateway_settings(ready_probe_timeout_s=PROBE_S, **settings), bus, store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        yield Gateway(client, app.state.gateway.registry)


@dataclass
class Gateway:
    http: httpx.AsyncClient
    registry: ModelRegistry

    async def get(self, path: str) -> httpx.Response:
        return await self.http.get(path)

    async def record(self, *anns: Announcement) -> None:
        for ann in anns:
            await self.registry.record(ann)


class Instance:
    """A real Announcer for one service instance; its heartbeat age is settable."""

    def __init__(self, bus: Bus, service: str, model: str | None):
        self.age: float | None = 0.1 if service == "engine" else None
        self.ann = Announcement(service=service, instance=f"{service}-{uuid.uuid4().hex[:8]}",  # type: ignore[arg-type]
                                model=model)
        self.announcer = Announcer(bus, service, self.ann.instance, 30.0, self.ann.model_copy,
                                   heartbeat_age=lambda: self.age)

    async def __aenter__(self) -> Instance:
        await self.announcer.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.announcer.stop()


async def test_health_is_liveness_of_the_process_and_its_nats_connection(bus: Bus) -> None:
    async with gateway_client(bus, MemoryStore()) as client:
        r = await client.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    lost = await Bus.connect(NATS_URL, "test-health-lost")
    await lost.nc.close()
    async with gateway_client(lost, MemoryStore()) as client:
        r = await client.get("/health")
        assert r.status_code == 503 and "NATS" in r.json()["error"]["message"]
        validate_openai("ErrorResponse", r.json())
        assert r.headers["retry-after"] == "1"
        body = check_ready_body(await client.get("/ready"))
        assert body["nats"] == "disconnected"


async def test_ready_needs_a_tokenizer_and_an_engine_answering_for_each_model(bus: Bus) -> None:
    model = f"ready-{uuid.uuid4().hex[:6]}"
    async with gateway_client(bus, MemoryStore()) as client:
        body = check_ready_body(await client.get("/ready"))
        assert body["reasons"] == [
            "no model is served yet (no tokenizer or engine has announced itself)"]
        async with Instance(bus, "tokenizer", model) as tok:
            await client.record(tok.ann)
            body = check_ready_body(await client.get("/ready"))
            assert body["models"] == {model: False}
            assert body["reasons"] == [f"{model}: no engine answers (none announced)"]
            async with Instance(bus, "engine", model) as eng:
                await client.record(eng.ann)
                body = check_ready_body(await client.get("/ready"))
                assert body["status"] == "ready" and body["models"] == {model: True}
                assert {i["state"] for i in body["instances"]} == {"ok"}

                eng.age = 12.5  # the step loop has not gone round: a wedged engine
                body = check_ready_body(await client.get("/ready"))
                assert body["reasons"] == [
                    f"{model}: no engine answers ({eng.ann.instance} step loop stuck for 12.5s)"]
                eng.age = 0.2
                assert (await client.get("/ready")).status_code == 200
            # the engine process is gone but its announcement is still within the TTL
            body = check_ready_body(await client.get("/ready"))
            assert body["reasons"] == [
                f"{model}: no engine answers ({eng.ann.instance} gone (no responder))"]


async def test_a_frozen_instance_is_silent_and_another_one_keeps_the_model_ready(
        bus: Bus) -> None:
    model = f"ready-{uuid.uuid4().hex[:6]}"
    frozen = Announcement(service="tokenizer", instance=f"tokenizer-frozen-{uuid.uuid4().hex[:6]}",
                          model=model)

    async def never(_: HealthRequest) -> None:
        await asyncio.sleep(30)  # a process whose event loop no longer runs answers nothing

    sub = await bus.serve(subjects.instance_health("tokenizer", frozen.instance), HealthRequest,
                          never)
    try:
        async with (gateway_client(bus, MemoryStore()) as client,
                    Instance(bus, "engine", model) as eng):
            await client.record(frozen, eng.ann)
            started = asyncio.get_running_loop().time()
            body = check_ready_body(await client.get("/ready"))
            assert asyncio.get_running_loop().time() - started < PROBE_S + 1.0
            assert body["reasons"] == [f"{model}: no tokenizer answers ({frozen.instance} "
                                       f"not answering within {PROBE_S:g}s)"]
            async with Instance(bus, "tokenizer", model) as tok:  # a second, live replica
                await client.record(tok.ann)
                body = check_ready_body(await client.get("/ready"))
                assert body["status"] == "ready"
                states = {i["instance"]: i["state"] for i in body["instances"]}
                assert states[frozen.instance] == "silent" and states[tok.ann.instance] == "ok"
    finally:
        await sub.unsubscribe()


async def test_a_registered_tools_service_must_answer(bus: Bus) -> None:
    model = f"ready-{uuid.uuid4().hex[:6]}"
    async with (gateway_client(bus, MemoryStore()) as client,
                Instance(bus, "tokenizer", model) as tok, Instance(bus, "engine", model) as eng):
        tools = Instance(bus, "tools", None)
        await client.record(tok.ann, eng.ann, tools.ann)  # tools announced, then died
        body = check_ready_body(await client.get("/ready"))
        assert body["models"] == {model: True}
        assert body["reasons"] == [f"no tools service answers ({tools.ann.instance} gone "
                                   "(no responder))"]
        async with tools:
            assert (await client.get("/ready")).status_code == 200


@pytest.fixture
def redis_port() -> int:
    """A closed port where a Redis can be started later."""
    return free_port()


def start_redis(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_unreachable_redis_is_one_error_line_503s_and_recovers_on_its_own(
        bus: Bus, redis_port: int, caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://127.0.0.1:{redis_port}/0"
    store = RedisStore(url, namespace=f"flotilla-test-{uuid.uuid4().hex[:6]}:")
    model = f"ready-{uuid.uuid4().hex[:6]}"
    caplog.set_level(logging.INFO)
    redis: subprocess.Popen[bytes] | None = None
    try:
        async with (gateway_client(bus, store) as client,
                    Instance(bus, "tokenizer", model) as tok,
                    Instance(bus, "engine", model) as eng):
            await client.record(tok.ann, eng.ann)  # announcements fail to be recorded
            for _ in range(20):  # a poller asking every few ms
                body = check_ready_body(await client.get("/ready"))
                assert body["reasons"] == [f"Redis at {url} unreachable: connection refused"]
                assert body["store"] == f"Redis at {url}"
            r = await client.get("/v1/models")
            assert r.status_code == 503
            validate_openai("ErrorResponse", r.json())
            assert r.json()["error"]["code"] == "store_unavailable"
            chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            r = await client.http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 200  # still alive
            errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
            assert len(errors) == 1, [rec.getMessage() for rec in errors]
            assert errors[0].getMessage().startswith(
                f"Redis at {url} unreachable: connection refused")
            assert not any(rec.exc_info for rec in caplog.records)

            redis = start_redis(redis_port)
            for _ in range(100):  # announcements are recorded again, /ready turns 200
                await client.record(tok.ann, eng.ann)
                if (await client.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            body = check_ready_body(await client.get("/ready"))
            assert body["models"] == {model: True}
            assert any("reachable again" in rec.getMessage() for rec in caplog.records)
    finally:
        await store.close()
        if redis is not None:
            redis.terminate()
            redis.wait(10)


async def test_store_outage_503s_carry_retry_after(bus: Bus, redis_port: int) -> None:
    store = RedisStore(f"redis://127.0.0.1:{redis_port}/0")
    try:
        async with gateway_client(bus, store) as client:
            r = await client.get("/v1/models")
            assert r.status_code == 503 and float(r.headers["retry-after"]) > 0
    finally:
        await store.close()
