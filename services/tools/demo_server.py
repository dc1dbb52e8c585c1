"""A small stdio MCP server shipped for the container stack (docker/mcp.json starts it), so a
fresh `docker compose up` has tools to offer: `add(a, b)` and `utc_now()`.

Run: `python -m flotilla.services.tools.demo_server`.
"""

from __future__ import annotations

from datetime import UTC, datetime

try:
    from mcp.server.mcpserver import MCPServer as FastMCP
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP  # type: ignore[no-redef,attr-defined]

server = FastMCP("demo")


@server.tool()
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@server.tool()
def utc_now() -> str:
    """The current date and time in UTC, ISO 8601."""
    return datetime.now(UTC).isoformat(timespec="seconds")


if __name__ == "__main__":
    server.run()
