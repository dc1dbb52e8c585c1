"""A tiny real MCP server over stdio, for tests of the tools service.

Tools: `add(a, b)`, `echo(text)`, `fail(message)` (always errors), `sleep(seconds)` (for
timeouts) and `record(text)` (appends a line to the file named by `MCP_TEST_RECORD`: a side
effect a test can see). Written with the official `mcp` SDK (FastMCP in 1.x, renamed
MCPServer in 2.x).
Run: `python tests/mcp_server.py [server-name]`.
"""

from __future__ import annotations

import asyncio
import os
import sys

try:
    from mcp.server.mcpserver import MCPServer as FastMCP
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP  # type: ignore[no-redef]

server = FastMCP(sys.argv[1] if len(sys.argv) > 1 else "test")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def fail(message: str) -> str:
    """Always raise an error with the given message."""
    raise ValueError(message)


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def record(text: str) -> str:
    """Append the text as a line to the record file."""
    with open(os.environ["MCP_TEST_RECORD"], "a") as f:
        f.write(text + "\n")
    return f"recorded {text}"


if __name__ == "__main__":
    server.run()
