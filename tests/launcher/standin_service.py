"""A stand-in for a flotilla service, for launcher tests: `python -m tests.launcher.standin_service
NAME`. It reads the same FLOTILLA_* settings as the real service; "gateway" answers any GET (the
launcher asks /ready) on FLOTILLA_HOST:FLOTILLA_PORT with 200 while its NATS connection is up and
503 while it is not, as the real gateway's /ready does; the others announce themselves and answer
health on NATS (as the real services do through libs.common.service)."""

from __future__ import annotations

import asyncio
import sys

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Announcement
from flotilla.libs.common.service import Announcer, instance_id, run_forever
from flotilla.libs.common.settings import (
    CommonSettings,
    EngineSettings,
    GatewaySettings,
    TokenizerSettings,
)


class StandIn:
    def __init__(self, name: str, settings: CommonSettings, bus: Bus):
        self.name, self.settings, self.bus = name, settings, bus
        instance = instance_id(name)
        model = getattr(settings, "served_model_name", None)
        self.announcer = Announcer(bus, name, instance, settings.discovery_interval_s,
                                   lambda: Announcement(service=name, instance=instance,  # type: ignore[arg-type]
                                                        model=model))
        self.http: asyncio.Server | None = None

    async def start(self) -> None:
        if isinstance(self.settings, GatewaySettings):
            self.http = await asyncio.start_server(self._health, self.settings.host,
                                                   self.settings.port)
        await self.announcer.start()

    async def _health(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if self.bus.connected:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        else:
            body = b'{"reasons": ["the gateway\'s NATS connection is down (reconnecting)"]}'
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (len(body), body))
        await writer.drain()
        writer.close()

    async def drain(self, timeout_s: float) -> None:
        pass  # a stand-in holds no work in flight

    async def stop(self) -> None:
        await self.announcer.stop()
        if self.http is not None:
            self.http.close()


def main() -> None:
    name = sys.argv[1]
    kinds: dict[str, type[CommonSettings]] = {
        "gateway": GatewaySettings, "tokenizer": TokenizerSettings, "engine": EngineSettings}
    settings = kinds.get(name, CommonSettings)()
    run_forever(name, settings, lambda bus: StandIn(name, settings, bus))


if __name__ == "__main__":
    main()
