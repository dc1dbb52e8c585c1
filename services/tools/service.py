"""The tools service: serves the MCP tool list and tool calls over NATS.

Thin adapter over `ToolRegistry`: TOOLS_LIST → ToolsListReply, TOOLS_CALL → ToolCallReply, both
in queue group "tools" so replicas share the load. It announces itself as service "tools".
Its metrics (`flotilla:tool_calls_total`, `flotilla:tool_call_seconds`, by MCP server) are served
on `settings.metrics_port`. On SIGTERM it takes no new calls and waits for the running ones.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Announcement
from flotilla.libs.common.metrics import MetricsServer
from flotilla.libs.common.service import Announcer, instance_id, wait_idle
from flotilla.libs.common.settings import ToolsSettings
from flotilla.libs.common.tool_messages import (
    McpToolRoute,
    ToolCallReply,
    ToolCallRequest,
    ToolsListReply,
    ToolsListRequest,
)
from flotilla.services.tools.config import load_mcp_config
from flotilla.services.tools.metrics import ToolsMetrics
from flotilla.services.tools.registry import ToolRegistry

log = logging.getLogger(__name__)

QUEUE = "tools"


class ToolsService:
    def __init__(self, settings: ToolsSettings, bus: Bus):
        self.settings, self.bus = settings, bus
        self.instance = instance_id("tools")
        self.registry = ToolRegistry(
            load_mcp_config(settings.mcp_config),
            start_timeout_s=max(settings.tool_call_timeout_s, settings.request_timeout_s),
            call_timeout_s=settings.tool_call_timeout_s,
            result_max_chars=settings.tool_result_max_chars,
        )
        self.announcer = Announcer(bus, "tools", self.instance, settings.discovery_interval_s,
                                   self._announcement, self._health)
        self._subs: list[Any] = []
        self._calls = 0  # tool calls running
        self.metrics = ToolsMetrics()
        self._metrics_server = MetricsServer(self.metrics.registry, settings.metrics_host,
                                             settings.metrics_port)

    async def start(self) -> None:
        self._metrics_server.start()
        await self.registry.start()
        self._subs = [
            await self.bus.serve(subjects.TOOLS_LIST, ToolsListRequest, self._list, queue=QUEUE),
            await self.bus.serve(subjects.TOOLS_CALL, ToolCallRequest, self._call, queue=QUEUE),
        ]
        await self.announcer.start()

    async def drain(self, timeout_s: float) -> None:
        self.announcer.draining = True
        await self.bus.unsubscribe_all(self._subs)  # replicas take the new calls
        await wait_idle(lambda: self._calls, timeout_s)

    async def stop(self) -> None:
        await self.announcer.stop()
        await self.bus.unsubscribe_all(self._subs)
        await self.registry.close()
        self._metrics_server.stop()

    async def _list(self, _: ToolsListRequest) -> ToolsListReply:
        routes = {name: McpToolRoute(server=r.server, tool=r.tool)
                  for name, r in self.registry.routes.items()}
        return ToolsListReply(tools=self.registry.tools, errors=self.registry.current_errors(),
                              catalog=self.registry.catalog, routes=routes)

    async def _call(self, req: ToolCallRequest) -> ToolCallReply:
        route = self.registry.routes.get(req.name)
        server = route.server if route is not None else "unknown"
        self._calls += 1
        start = time.monotonic()
        try:
            result = await self.registry.call(req.name, req.arguments, req.servers)
        except Exception as exc:  # a reply, never silence: the caller would wait for nothing
            log.exception("tool call %s crashed", req.name)
            self.metrics.calls.labels(server, "crashed").inc()
            return ToolCallReply(ok=False, error=f"tool {req.name!r} crashed: {exc}")
        finally:
            self._calls -= 1
            self.metrics.seconds.labels(server).observe(time.monotonic() - start)
        self.metrics.calls.labels(server, "ok" if result.ok else "error").inc()
        if not result.ok:
            log.info("tool call %s failed: %s", req.name, result.error)
        return ToolCallReply(ok=result.ok, content=result.content, error=result.error)

    def _announcement(self) -> Announcement:
        return Announcement(service="tools", instance=self.instance)

    async def _health(self) -> dict[str, Any]:
        return {"servers": sorted(self.registry.connections), "tools": len(self.registry.tools),
                "errors": self.registry.current_errors()}
