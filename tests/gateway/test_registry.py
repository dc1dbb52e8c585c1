"""The model registry: built from announcements, expiring with the TTL, shared through Redis by
gateway replicas."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Announcement
from flotilla.libs.common.store import MemoryStore, RedisStore
from flotilla.services.gateway.app import create_app
from flotilla.services.gateway.registry import ModelRegistry
from tests.endpoints import REDIS_URL
from tests.gateway.conftest import gateway_settings
from tests.gateway.schemas import validate_openai


def _ann(service: str, model: str, instance: str | None = None) -> Announcement:
    return Announcement(service=service, instance=instance or f"{service}-{uuid.uuid4().hex[:6]}",  # type: ignore[arg-type]
                        model=model, max_model_len=1024)


async def test_tokenizer_lists_model_and_engine_makes_it_ready(bus: Bus) -> None:
    registry = ModelRegistry(bus, MemoryStore(), ttl_s=0.3)
    await registry.record(_ann("tokenizer", "m1"))
    [info] = await registry.models()
    assert (info.id, info.max_model_len) == ("m1", 1024)
    health = await registry.health()
    assert health.ready == [] and health.models_without_engine == ["m1"]
    await registry.record(_ann("engine", "m1"))
    assert (await registry.health()).ready == ["m1"]
    await asyncio.sleep(0.4)  # nobody announces any more: everything expires
    assert await registry.models() == [] and (await registry.health()).services == {}


async def test_capabilities_come_from_the_engines_announcement(bus: Bus) -> None:
    """Unknown (no field, every request let through) until an engine says; then listed on
    the OpenAI Model object, which stays valid against the official schema."""
    registry = ModelRegistry(bus, MemoryStore(), ttl_s=5)
    await registry.record(_ann("tokenizer", "emb"))
    [info] = await registry.models()
    assert info.capabilities is None and "capabilities" not in info.openai()
    assert info.cannot("generate") is None
    engine = _ann("engine", "emb").model_copy(update={"capabilities": ["embed", "score"]})
    await registry.record(engine)
    [info] = await registry.models()
    validate_openai("Model", info.openai())
    assert info.openai()["capabilities"] == ["embed", "score"]
    assert info.cannot("embed") is None and info.cannot("score") is None
    assert "cannot serve text generation" in (info.cannot("generate") or "")


async def test_replicas_share_the_registry_through_redis(bus: Bus) -> None:
    namespace = f"flotilla-test-{uuid.uuid4().hex[:8]}:"
    try:
        first, second = RedisStore(REDIS_URL, namespace), RedisStore(REDIS_URL, namespace)
        await first.get("probe")
    except Exception as exc:  # pragma: no cover - Redis is part of the dev environment
        pytest.skip(f"no Redis: {exc}")
    try:
        writer = ModelRegistry(bus, first, ttl_s=5)
        reader = ModelRegistry(bus, second, ttl_s=5)  # a replica that heard nothing itself
        await writer.record(_ann("tokenizer", "shared/model"))
        info, own = await reader.get("shared/model"), await writer.get("shared/model")
        assert info is not None and own is not None and info.created == own.created
    finally:
        for key in await first.scan(""):
            await first.delete(key)
        await first.close()
        await second.close()


async def test_gateway_learns_models_from_live_announcements(gateway, model: str) -> None:  # type: ignore[no-untyped-def]
    # The package's gateway subscribed at start and pinged: the fake tokenizer answered.
    assert await gateway.state.registry.get(model) is not None


async def test_a_bug_is_a_500_envelope_not_a_traceback(bus: Bus) -> None:
    app = create_app(gateway_settings(), bus, MemoryStore())

    async def broken() -> None:
        raise RuntimeError("boom")

    app.state.gateway.registry.models = broken
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.get("/v1/models")
    assert r.status_code == 500
    validate_openai("ErrorResponse", r.json())
    assert r.json()["error"]["type"] == "server_error" and "boom" not in r.text
