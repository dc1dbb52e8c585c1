"""Is the suite ready, and if not, why: the launcher's and `flotilla status`'s one check.

Ready means: the gateway answers GET /ready with 200 (its NATS connection is up, the store
answers, every served model has a tokenizer and an engine answering their own probes, the
engine's step loop beating; health.py in the gateway) and every NATS service the launcher runs
(tokenizer, engine, tools) answers its health subject itself. Not ready comes with reasons, one
line each, taken from /ready's body where the gateway gave them ("Redis at ... unreachable:
connection refused").

`Probe` is the check on one event loop (one HTTP client, one NATS connection kept between
checks). `Prober` runs it every `interval_s` on a thread of its own, so the launcher's main
loop, which restarts dead children, never waits for a check (a frozen service makes one take
about a probe timeout).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import httpx

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import HealthReply, HealthRequest
from flotilla.libs.common.nats_auth import NatsSecurity
from flotilla.services.launcher.nats_server import reachable

HTTP_TIMEOUT_S = 3.0  # /ready answers within its probe timeout (1.5 s) whatever is down
NATS_TIMEOUT_S = 1.5


@dataclass(frozen=True)
class Verdict:
    """One check's result: `reasons` empty = ready; `started` = monotonic time it began."""

    reasons: tuple[str, ...]
    started: float

    @property
    def ready(self) -> bool:
        return not self.reasons


async def gateway_reasons(http: httpx.AsyncClient, ready_url: str) -> list[str]:
    try:
        r = await http.get(ready_url, timeout=HTTP_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return [f"gateway not answering at {ready_url}: {exc or type(exc).__name__}"]
    if r.status_code == 200:
        return []
    try:
        reasons = [str(line) for line in r.json()["reasons"]]
    except (ValueError, KeyError, TypeError):
        reasons = []
    return reasons or [f"gateway /ready answered {r.status_code}"]


class Probe:
    """Checks readiness over one HTTP client and one NATS connection (made on first use, then
    kept: nats-py reconnects it on its own)."""

    def __init__(self, ready_url: str | None, nats_url: str, nats_services: list[str],
                 security: NatsSecurity | None = None):
        self.ready_url, self.nats_url, self.nats_services = ready_url, nats_url, nats_services
        self.security = security
        self._http: httpx.AsyncClient | None = None
        self._bus: Bus | None = None

    async def reasons(self) -> list[str]:
        """Why the suite is not ready (empty: it is)."""
        if self._http is None:
            self._http = httpx.AsyncClient()
        found = await gateway_reasons(self._http, self.ready_url) if self.ready_url else []
        if not self.nats_services:
            return found
        if self._bus is None:
            # nats-py's first connect retries forever when nothing answers: look first
            if not await asyncio.to_thread(reachable, self.nats_url):
                return [*found, f"NATS at {self.nats_url} unreachable"]
            self._bus = await Bus.connect(self.nats_url, "flotilla-launcher",
                                          security=self.security)
        if not self._bus.connected:
            return [*found, f"NATS at {self.nats_url} unreachable (reconnecting)"]
        answers = await asyncio.gather(*(self._answers(s) for s in self.nats_services))
        return found + [f"{service} not answering its health check on NATS"
                        for service, ok in zip(self.nats_services, answers, strict=True)
                        if not ok]

    async def _answers(self, service: str) -> bool:
        assert self._bus is not None
        try:
            reply = await self._bus.request(subjects.health(service), HealthRequest(),
                                            HealthReply, timeout=NATS_TIMEOUT_S)
        except FlotillaError:
            return False
        return reply.ok

    async def verdict(self) -> Verdict:
        started = time.monotonic()
        return Verdict(tuple(await self.reasons()), started)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        if self._bus is not None:
            await self._bus.close()


class Prober:
    """Runs `probe` every `interval_s` on its own thread; `latest` is the newest verdict."""

    def __init__(self, probe: Probe, interval_s: float = 0.5):
        self.probe, self.interval_s = probe, interval_s
        self.latest: Verdict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readiness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        try:
            while not self._stop.is_set():
                self.latest = await self.probe.verdict()
                await asyncio.sleep(self.interval_s)
        finally:
            await self.probe.close()


async def check_once(probe: Probe) -> Verdict:
    """One check (`flotilla status`), closing the probe's connections after."""
    try:
        return await probe.verdict()
    finally:
        await probe.close()
