"""The tools core: MCP servers, their tools as OpenAI function tools, and calls routed by name.

Rules:
- A tool is exposed as `<server>_<tool>`, sanitised to [a-zA-Z0-9_-] and at most 64 characters
  (OpenAI's limits); a name that would be too long or collide gets a short hash suffix, so every
  exposed name routes to exactly one (server, tool).
- A server that fails to start is reported in `errors` by server name; the others still serve.
- The registry owns its connections: `close()` ends every session and server process.
- `catalog` lists every exposed tool; `tools` only those of servers that `inject` (offered to
  chat requests without `tools`). A call may carry an allowlist of servers; a tool of any
  other server is refused before its server is contacted. Results are cut at
  `result_max_chars`.
No NATS here: the service adapts this to the bus, tests drive it directly.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from dataclasses import dataclass
from typing import Any

from flotilla.services.tools.config import McpServerConfig
from flotilla.services.tools.connection import McpConnection, McpToolError, describe

log = logging.getLogger(__name__)

MAX_NAME_LEN = 64
_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")


def exposed_name(server: str, tool: str, taken: set[str] | frozenset[str] = frozenset()) -> str:
    """The OpenAI function name of MCP tool `tool` on `server`."""
    name = _UNSAFE.sub("_", f"{server}_{tool}")
    if len(name) <= MAX_NAME_LEN and name not in taken:
        return name
    digest = hashlib.sha1(f"{server}\0{tool}".encode()).hexdigest()[:8]
    return f"{name[:MAX_NAME_LEN - 9]}_{digest}"


def openai_tool(name: str, mcp_tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool (wire shape) as an OpenAI function tool; its inputSchema is the parameters."""
    schema = mcp_tool.get("inputSchema") or {"type": "object", "properties": {}}
    function: dict[str, Any] = {"name": name, "parameters": schema}
    if mcp_tool.get("description"):
        function["description"] = mcp_tool["description"]
    return {"type": "function", "function": function}


@dataclass(frozen=True)
class Route:
    server: str
    tool: str


@dataclass(frozen=True)
class CallResult:
    ok: bool
    content: str = ""
    error: str | None = None


class ToolRegistry:
    """Every configured MCP server, started together and listed once at start-up."""

    def __init__(self, servers: dict[str, McpServerConfig], start_timeout_s: float,
                 call_timeout_s: float, result_max_chars: int = 65536):
        self.configs = servers
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.result_max_chars = result_max_chars
        self.connections: dict[str, McpConnection] = {}
        self.catalog: list[dict[str, Any]] = []  # every exposed tool
        self.tools: list[dict[str, Any]] = []  # those of servers that inject (chat requests)
        self.errors: dict[str, str] = {}
        self._routes: dict[str, Route] = {}

    async def start(self) -> None:
        """Start all servers concurrently and collect their tools; never raises for one server."""
        names = list(self.configs)
        results = await asyncio.gather(*(self._start_one(n) for n in names))
        for name, tools in zip(names, results, strict=True):
            if tools is None:
                continue
            config = self.configs[name]
            for mcp_tool in tools:
                if config.allowed_tools is not None and mcp_tool["name"] not in \
                        config.allowed_tools:
                    continue
                exposed = exposed_name(name, mcp_tool["name"], set(self._routes))
                self._routes[exposed] = Route(name, mcp_tool["name"])
                self.catalog.append(openai_tool(exposed, mcp_tool))
                if config.inject:
                    self.tools.append(self.catalog[-1])
        log.info("MCP: %d tools from %d servers (%d failed)", len(self.tools),
                 len(self.connections), len(self.errors))

    async def _start_one(self, name: str) -> list[dict[str, Any]] | None:
        conn = McpConnection(name, self.configs[name])
        try:
            await conn.start(self.start_timeout_s)
            tools = await asyncio.wait_for(conn.list_tools(), self.start_timeout_s)
        except Exception as exc:
            await conn.close()
            self.errors[name] = describe(exc)
            log.error("MCP server %r unavailable: %s", name, self.errors[name])
            return None
        self.connections[name] = conn
        return tools

    def current_errors(self) -> dict[str, str]:
        """Start-up failures plus servers that died since."""
        errors = dict(self.errors)
        for name, conn in self.connections.items():
            if not conn.alive:
                errors[name] = f"stopped: {conn.failure or 'unknown reason'}"
        return errors

    @property
    def routes(self) -> dict[str, Route]:
        """Exposed name → (server, tool), for every exposed tool."""
        return dict(self._routes)

    async def call(self, name: str, arguments: dict[str, Any],
                   servers: list[str] | None = None) -> CallResult:
        """Run tool `name`. `servers` (an allowlist; None = any): a tool of another server is
        refused without contacting it. A result longer than `result_max_chars` is cut."""
        route = self._routes.get(name)
        if route is None:
            return CallResult(ok=False, error=f"unknown tool {name!r}")
        if servers is not None and route.server not in servers:
            return CallResult(ok=False, error=f"tool {name!r} belongs to MCP server "
                              f"{route.server!r}, which this request may not use")
        try:
            text = await self.connections[route.server].call_tool(route.tool, arguments,
                                                                  self.call_timeout_s)
        except McpToolError as exc:
            return CallResult(ok=False, error=str(exc))
        if len(text) > self.result_max_chars:
            cut = len(text) - self.result_max_chars
            text = text[:self.result_max_chars] + f"\n[... {cut} more characters cut]"
        return CallResult(ok=True, content=text)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.connections.values()))
        self.connections.clear()
