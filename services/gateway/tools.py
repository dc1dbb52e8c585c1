"""MCP tool injection: which tools a chat request offers the model.

Rules:
- A request with its own `tools` keeps them; `tools: []` opts out (no tools at all).
- A request without `tools` (absent or null) gets the tools service's list. No tools service, a
  slow one, or a broken reply means no tools: tool injection never fails a request.
- `ToolsCache` keeps that list (or its absence) for `ttl_s`, fetched once for all the requests
  that need it meanwhile (no NATS round trip per chat request). A tools instance announcing
  itself for the first time (a start or restart: it lists its servers' tools once, at start)
  drops the cached list at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import Announcement
from flotilla.libs.common.tool_messages import ToolsListReply, ToolsListRequest

log = logging.getLogger(__name__)


async def mcp_listing(bus: Bus, timeout_s: float) -> ToolsListReply:
    """The tools service's listing, or an empty one when none answers within `timeout_s`."""
    try:
        reply = await bus.request(subjects.TOOLS_LIST, ToolsListRequest(), ToolsListReply,
                                  timeout=timeout_s)
    except FlotillaError as exc:
        log.debug("no MCP tools: %s", exc)
        return ToolsListReply(tools=[])
    except Exception as exc:  # a malformed reply must not fail the user's request
        log.warning("tools service reply unusable: %s", exc)
        return ToolsListReply(tools=[])
    for server, error in reply.errors.items():
        log.info("MCP server %s unavailable: %s", server, error)
    return reply


async def mcp_tools(bus: Bus, timeout_s: float) -> list[dict[str, Any]]:
    """The tools service's injected function tools, or [] when none answers in `timeout_s`."""
    return list((await mcp_listing(bus, timeout_s)).tools)


async def tools_for(body: dict[str, Any], bus: Bus,
                    timeout_s: float) -> list[dict[str, Any]] | None:
    """The tools to send with a chat request (None = no tools)."""
    own = body.get("tools")
    if own is not None:
        return list(own) or None
    return await mcp_tools(bus, timeout_s) or None


class ToolsCache:
    """The MCP tool list, refreshed at most every `ttl_s` (0: asked for every request)."""

    def __init__(self, bus: Bus, timeout_s: float, ttl_s: float):
        self.bus, self.timeout_s, self.ttl_s = bus, timeout_s, ttl_s
        self._listing = ToolsListReply(tools=[])
        self._expires = 0.0
        self._fetch: asyncio.Future[ToolsListReply] | None = None
        self._instances: set[str] = set()
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(subjects.DISCOVERY_ANNOUNCE, Announcement,
                                             self._on_announce)

    async def stop(self) -> None:
        if self._sub is not None:
            await self.bus.unsubscribe_all([self._sub])
            self._sub = None

    async def _on_announce(self, ann: Announcement) -> None:
        if ann.service == "tools" and ann.instance not in self._instances:
            self._instances.add(ann.instance)
            self.invalidate()

    def invalidate(self) -> None:
        self._expires = 0.0
        self._fetch = None  # a fetch in flight may predate the new instance

    async def listing(self) -> ToolsListReply:
        """The whole listing (injected tools, catalog, routes); do not mutate it."""
        if self.ttl_s > 0 and time.monotonic() < self._expires:
            return self._listing
        if self._fetch is None:
            self._fetch = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._fetch)

    async def tools(self) -> list[dict[str, Any]]:
        """The tools injected into chat requests without `tools`."""
        return list((await self.listing()).tools)

    async def _refresh(self) -> ToolsListReply:
        me = self._fetch
        listing = await mcp_listing(self.bus, self.timeout_s)
        if self._fetch is me:  # not invalidated meanwhile
            self._listing, self._expires = listing, time.monotonic() + self.ttl_s
            self._fetch = None
        return listing

    async def tools_for(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The tools to send with a chat request (None = no tools), as `tools_for`."""
        own = body.get("tools")
        if own is not None:
            return list(own) or None
        return await self.tools() or None
