"""GatewayService: the HTTP server (uvicorn) inside the caller's event loop, plus the gateway's
own discovery announcements.

Rules:
- `start()` returns once the socket is bound and the server accepts connections (`port` is then
  the real port, also when configured as 0); a port in use fails `start()` with OSError. With
  `reuse_port` (a worker of several: services/gateway/workers.py) it binds with SO_REUSEPORT,
  beside its sibling workers on the same port.
- HTTP/1.1 is uvicorn's httptools protocol with bounds on the request head (http_protocol.py:
  `max_header_bytes`, `max_headers`; 431 and the connection closed beyond them).
- uvicorn's own signal handling is off: the process owner (`run_forever`, or a test) decides
  when to `drain()` (SIGTERM: drain.py) and `stop()`. Streams still open at `stop()` get
  `shutdown_grace_s` to finish, then are cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Generator
from typing import Any

import uvicorn

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Announcement
from flotilla.libs.common.service import Announcer, instance_id
from flotilla.libs.common.settings import GatewaySettings
from flotilla.libs.common.store import Store, make_store
from flotilla.services.gateway.app import GatewayState, create_app
from flotilla.services.gateway.http_protocol import limited_protocol

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the service's owner handles signals


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class GatewayService:
    """`GatewayService(settings, bus)`; `await start()` / `await stop()`."""

    shutdown_grace_s = 2

    def __init__(self, settings: GatewaySettings, bus: Bus, store: Store | None = None,
                 reuse_port: bool = False):
        self.settings, self.bus = settings, bus
        self.store = store if store is not None else make_store(settings.redis_url)
        self.app = create_app(settings, bus, self.store)
        self.state: GatewayState = self.app.state.gateway
        self.instance = instance_id("gateway")
        self.announcer = Announcer(bus, "gateway", self.instance, settings.discovery_interval_s,
                                   make=lambda: Announcement(service="gateway",
                                                             instance=self.instance),
                                   health=self._health_detail)
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[Any] | None = None
        self.reuse_port = reuse_port
        self.port = settings.port

    @property
    def url(self) -> str:
        host = self.settings.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    async def _health_detail(self) -> dict[str, Any]:
        view = await self.state.registry.health()
        return {"ready_models": view.ready, "services": view.services, "url": self.url}

    async def start(self) -> None:
        await self.state.start()
        sock = bind_socket(self.settings.host, self.settings.port, self.reuse_port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="off", log_level=self.settings.log_level.lower(),
                                timeout_graceful_shutdown=self.shutdown_grace_s,
                                access_log=False,
                                http=limited_protocol(self.settings.max_header_bytes,
                                                      self.settings.max_headers))
        self._server = _EmbeddedServer(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server exited during start-up")
            await asyncio.sleep(0.01)
        await self.announcer.start()
        log.info("gateway %s listening on %s", self.instance, self.url)

    async def drain(self, timeout_s: float) -> None:
        """New requests get 503 `draining` and /ready says not ready; wait up to `timeout_s`
        for the requests in flight (open streams) to end."""
        self.state.drain.begin()
        self.announcer.draining = True
        if not await self.state.drain.wait(timeout_s):
            log.warning("gateway %s: %d requests still in flight after the %gs drain; cutting "
                        "them", self.instance, self.state.drain.active, timeout_s)

    async def stop(self) -> None:
        await self.announcer.stop()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._task, self.shutdown_grace_s + 3)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        await self.state.stop()
        await self.store.close()
