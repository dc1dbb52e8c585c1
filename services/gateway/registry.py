"""Which models are served and which services are alive, from discovery announcements.

Rules:
- Every announcement refreshes `registry:svc:<service>:<instance>` in the Store with a TTL of
  `model_ttl_s`, so an instance that stops announcing disappears on its own and every gateway
  replica sharing the Store (Redis) sees the same registry.
- A model is served while at least one tokenizer announcing it is alive; `health()` counts it
  ready when an engine announcing it is alive too (/ready, in health.py, probes each instance).
- Its `max_model_len` is the smallest its live engines and tokenizers announce: the engines own
  the context length (what their KV cache holds) and publish it (libs/common/context.py).
- A model's capabilities come from its engines' announcements (model_capabilities.py).
- `created` of a model is the first time any gateway saw it, kept without TTL so it stays stable.
- `get()` (every generation request asks it) answers a model found within the last
  `lookup_cache_s` from memory, without reading the Store; a model not found is always read
  again, so a new model is served as soon as it is recorded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Announcement, Ping
from flotilla.libs.common.model_capabilities import Capability
from flotilla.libs.common.store import Store, StoreUnavailable

log = logging.getLogger(__name__)

_SVC = "registry:svc:"
_CREATED = "registry:created:"


@dataclass(frozen=True)
class ModelInfo:
    id: str
    created: int
    max_model_len: int | None
    # what the model serves, from its engines' announcements; None until an engine announces
    capabilities: tuple[Capability, ...] | None = None

    def openai(self) -> dict[str, Any]:
        body = {"id": self.id, "object": "model", "created": self.created,
                "owned_by": "flotilla", "max_model_len": self.max_model_len}
        if self.capabilities is not None:
            body["capabilities"] = list(self.capabilities)
        return body

    def cannot(self, capability: Capability) -> str | None:
        """Why this model cannot serve `capability`, or None (also when not yet known)."""
        if self.capabilities is None or capability in self.capabilities:
            return None
        return (f"model `{self.id}` cannot serve {_WHAT[capability]}: it serves "
                + ", ".join(_WHAT[c] for c in self.capabilities))


_WHAT: dict[Capability, str] = {
    "generate": "text generation (chat, completions, responses, messages)",
    "embed": "embeddings (/v1/embeddings)",
    "score": "scoring (/v1/score, /v1/rerank)",
}


@dataclass
class HealthView:
    ready: list[str]
    services: dict[str, int]
    models_without_engine: list[str] = field(default_factory=list)


class ModelRegistry:
    """Listens to DISCOVERY_ANNOUNCE and answers model and health questions from the Store."""

    lookup_cache_s = 1.0

    def __init__(self, bus: Bus, store: Store, ttl_s: float):
        self.bus, self.store, self.ttl_s = bus, store, ttl_s
        self._sub: Any = None
        self._found: dict[str, tuple[float, ModelInfo]] = {}  # model → (expiry, info)

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(subjects.DISCOVERY_ANNOUNCE, Announcement,
                                             self.record)
        await self.bus.publish(subjects.DISCOVERY_PING, Ping())

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection already closed
                pass
            self._sub = None

    async def record(self, ann: Announcement) -> None:
        key = f"{_SVC}{ann.service}:{ann.instance}"
        try:
            await self.store.set(key, ann.model_dump_json(), ttl_s=self.ttl_s)
            if ann.service == "tokenizer" and ann.model:
                created_key = _CREATED + ann.model
                if await self.store.get(created_key) is None:
                    await self.store.set(created_key, str(int(time.time())))
        except StoreUnavailable:  # logged by the store (once, then reminders); next one retries
            pass
        except Exception as exc:
            log.warning("registry: cannot record %s: %s", key, exc)

    async def alive(self) -> list[Announcement]:
        raw = await self.store.scan(_SVC)
        out = []
        for value in raw.values():
            try:
                out.append(Announcement.model_validate_json(value))
            except ValueError:  # a record of another protocol version: ignore it
                continue
        return out

    async def models(self) -> list[ModelInfo]:
        alive = await self.alive()
        served = {a.model for a in alive if a.service == "tokenizer" and a.model}
        caps: dict[str, tuple[Capability, ...]] = {}
        for a in sorted(alive, key=lambda a: a.instance):
            if a.service == "engine" and a.model and a.capabilities is not None:
                caps.setdefault(a.model, tuple(a.capabilities))
        lengths: dict[str, int | None] = dict.fromkeys(served)
        for a in alive:  # the smallest length any engine or tokenizer of the model publishes
            if a.model in served and a.service in ("engine", "tokenizer") and a.max_model_len:
                known = lengths[a.model]
                lengths[a.model] = a.max_model_len if known is None else min(known,
                                                                            a.max_model_len)
        infos = []
        for model, max_len in sorted(lengths.items()):
            created = await self.store.get(_CREATED + model)
            infos.append(ModelInfo(model, int(created) if created else int(time.time()), max_len,
                                   caps.get(model)))
        return infos

    async def get(self, model: str) -> ModelInfo | None:
        now = time.monotonic()
        hit = self._found.get(model)
        if hit is not None and now < hit[0]:
            return hit[1]
        found = None
        for info in await self.models():
            self._found[info.id] = (now + self.lookup_cache_s, info)
            if info.id == model:
                found = info
        if found is None:
            self._found.pop(model, None)
        return found

    async def health(self) -> HealthView:
        alive = await self.alive()
        services: dict[str, int] = {}
        for a in alive:
            services[a.service] = services.get(a.service, 0) + 1
        tokenized = {a.model for a in alive if a.service == "tokenizer" and a.model}
        engined = {a.model for a in alive if a.service == "engine" and a.model}
        return HealthView(ready=sorted(tokenized & engined), services=services,
                          models_without_engine=sorted(tokenized - engined))
