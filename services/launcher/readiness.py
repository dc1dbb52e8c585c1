"""When is the suite ready: the gateway answers GET /health with 200 (it has a live tokenizer and
engine for the model) and every NATS service (tokenizer, engine, tools) answers its health subject
itself, i.e. has finished starting (an engine answers once its model is loaded). While waiting, a
child that exits ends the wait with its last log lines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from libs.common import subjects
from libs.common.bus import Bus
from libs.common.errors import FlotillaError
from libs.common.messages import HealthReply, HealthRequest

GATEWAY = "gateway /health"


class NotReady(RuntimeError):
    """The suite did not become ready; the message says why."""


async def gateway_healthy(http: httpx.AsyncClient, health_url: str) -> bool:
    try:
        return (await http.get(health_url, timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


async def service_healthy(bus: Bus, service: str) -> bool:
    try:
        reply = await bus.request(subjects.health(service), HealthRequest(), HealthReply,
                                  timeout=1.0)
    except FlotillaError:
        return False
    return reply.ok


class Probe:
    """Checks readiness over one HTTP client and one NATS connection."""

    def __init__(self, health_url: str | None, nats_url: str, nats_services: list[str]):
        self.health_url, self.nats_url, self.nats_services = health_url, nats_url, nats_services
        self._http = httpx.AsyncClient()
        self._bus: Bus | None = None

    async def pending(self, skip: set[str] | frozenset[str] = frozenset()) -> set[str]:
        """What is not ready yet (`skip`: already known ready)."""
        waiting: set[str] = set()
        if self.health_url and GATEWAY not in skip:
            if not await gateway_healthy(self._http, self.health_url):
                waiting.add(GATEWAY)
        todo = [s for s in self.nats_services if s not in skip]
        if todo and self._bus is None:
            self._bus = await Bus.connect(self.nats_url, "flotilla-launcher")
        for service in todo:
            assert self._bus is not None
            if not await service_healthy(self._bus, service):
                waiting.add(service)
        return waiting

    async def close(self) -> None:
        await self._http.aclose()
        if self._bus is not None:
            await self._bus.close()


async def wait_ready(probe: Probe, timeout_s: float, check: Callable[[], None]) -> None:
    """Poll until ready. `check()` is called every round and raises to abort (a child died, a
    stop was requested)."""
    deadline = time.monotonic() + timeout_s
    everything = {GATEWAY} if probe.health_url else set()
    everything |= set(probe.nats_services)
    ready: set[str] = set()
    try:
        while True:
            check()
            ready = everything - await probe.pending(skip=ready)
            if ready == everything:
                return
            if time.monotonic() > deadline:
                raise NotReady(f"not ready after {timeout_s:g}s, still waiting for: "
                               f"{', '.join(sorted(everything - ready))}")
            await asyncio.sleep(0.25)
    finally:
        await probe.close()


async def probe_once(probe: Probe) -> bool:
    try:
        return not await probe.pending()
    finally:
        await probe.close()
