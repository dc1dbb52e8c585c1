"""What every service process shares: announcing itself, answering health, running until signalled.

A service is a class with `async start()` / `async stop()`; `run_forever` wires logging, tracing,
signals and the NATS connection, so each service's `__main__` is three lines. Tests start services
in-process with the same classes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from flotilla.libs.common import subjects, telemetry
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Announcement, HealthReply, HealthRequest, Ping
from flotilla.libs.common.nats_auth import NatsSecurity
from flotilla.libs.common.settings import CommonSettings

log = logging.getLogger(__name__)


def instance_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:8]}"


class Announcer:
    """Publishes `make()` on the discovery subject every `interval` seconds and whenever a Ping
    arrives; answers health requests for `service` (any instance) and for this instance alone
    (`subjects.instance_health`, what /ready asks) with `health()` and `heartbeat_age()`;
    not ok (`detail["draining"]`) once `draining` is set.

    Answering at all is the liveness signal (a frozen or dead process does not), so the reply
    is built from what the process already knows, never from a call that can block."""

    def __init__(self, bus: Bus, service: str, instance: str, interval: float,
                 make: Callable[[], Announcement],
                 health: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 heartbeat_age: Callable[[], float | None] | None = None):
        self.bus, self.service, self.instance = bus, service, instance
        self.interval, self.make, self._health = interval, make, health
        self._heartbeat_age = heartbeat_age
        self._task: asyncio.Task[Any] | None = None
        self._subs: list[Any] = []
        self.draining = False  # set by the service's drain: health answers not ok

    async def start(self) -> None:
        async def on_ping(_: Ping) -> None:
            await self.announce()

        async def on_health(_: HealthRequest) -> HealthReply:
            detail = await self._health() if self._health else {}
            age = self._heartbeat_age() if self._heartbeat_age else None
            if self.draining:
                detail = {**detail, "draining": True}
            return HealthReply(service=self.service, instance=self.instance,
                               ok=not self.draining, detail=detail, heartbeat_age_s=age)

        self._subs.append(await self.bus.subscribe(subjects.DISCOVERY_PING, Ping, on_ping))
        for subject in (subjects.health(self.service),
                        subjects.instance_health(self.service, self.instance)):
            self._subs.append(await self.bus.serve(subject, HealthRequest, on_health))
        self._task = self.bus.spawn(self._loop())
        await self.announce()

    async def announce(self) -> None:
        try:
            await self.bus.publish(subjects.DISCOVERY_ANNOUNCE, self.make())
        except Exception as exc:  # reconnecting: the next period retries
            log.debug("announce failed: %s", exc)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.announce()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self.bus.unsubscribe_all(self._subs)


class Service(Protocol):
    """`drain(timeout_s)`: stop taking new work and wait up to `timeout_s` for the work in
    flight to finish (SIGTERM); `stop()` then ends whatever is left."""

    async def start(self) -> None: ...
    async def drain(self, timeout_s: float) -> None: ...
    async def stop(self) -> None: ...


async def wait_idle(busy: Callable[[], int], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until `busy()` is 0 (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while busy():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


def freeze_heap(settings: CommonSettings) -> None:
    """After start-up (FLOTILLA_GC_FREEZE): what start-up made (modules, the model's wrappers,
    caches) goes to the collector's permanent generation, out of every later full collection."""
    if settings.gc_freeze:
        gc.collect()
        gc.freeze()


def run_forever(name: str, settings: CommonSettings,
                build: Callable[[Bus], Service]) -> None:
    """Connect to NATS, start the service, and stop it on a signal: SIGTERM drains first (no
    new work; the work in flight gets `settings.drain_timeout_s` to finish), SIGINT or a second
    signal stops at once. Then the service stops and the NATS connection drains and closes."""
    telemetry.setup_logging(settings.log_level)
    telemetry.setup_tracing(name, settings)

    async def main() -> None:
        signals: list[int] = []
        stop, hurry = asyncio.Event(), asyncio.Event()

        def on_signal(sig: int) -> None:
            (hurry if signals else stop).set()
            signals.append(sig)
            if sig == signal.SIGINT:
                hurry.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        bus = await Bus.connect(settings.nats_url, name, settings.nats_write_now,
                                security=NatsSecurity.from_settings(settings))
        service = build(bus)
        await service.start()
        freeze_heap(settings)
        log.info("%s started", name)
        await stop.wait()
        if not hurry.is_set() and settings.drain_timeout_s > 0:
            log.info("%s draining (up to %gs)", name, settings.drain_timeout_s)
            await _until_either(service.drain(settings.drain_timeout_s), hurry.wait())
        log.info("%s stopping", name)
        await service.stop()
        await bus.close()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())


async def _until_either(first: Awaitable[None], second: Awaitable[Any]) -> None:
    """Wait for whichever ends first; cancel the other."""
    tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.warning("drain failed: %s", task.exception())


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (uvicorn[standard] brings it): faster NATS and HTTP handling per
    request, which is what bursts of arrivals queue on; the default loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
