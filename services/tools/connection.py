"""One MCP server over stdio, kept open for the life of the tools service.

The `mcp` SDK's `stdio_client` and `ClientSession` are anyio context managers that must be
entered and left by the same task, so each connection owns a runner task that opens both, reports
readiness, and holds them until `close()`. Calls from other tasks go through the session's
streams. Leaving the contexts closes the server's stdin and, if it lingers, kills its process
tree (the SDK's shutdown sequence), so `close()` leaves no child behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

from mcp import ClientSession, StdioServerParameters
from mcp import types as mcp_types
from mcp.client.stdio import stdio_client

from flotilla.services.tools.config import McpServerConfig

log = logging.getLogger(__name__)


class McpToolError(Exception):
    """A tool call failed: the server said so, or it timed out, or the server is gone."""


def describe(exc: BaseException) -> str:
    """A one-line reason, looking inside the exception groups anyio task groups raise."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip() or type(exc).__name__
    return text if isinstance(exc, McpToolError) else f"{type(exc).__name__}: {text}"


def result_text(result: dict[str, Any]) -> str:
    """Flatten an MCP CallToolResult (wire shape) to the string a chat `tool` message carries:
    text parts joined by newlines; other parts (images, resources) as their JSON."""
    parts = []
    for item in result.get("content") or []:
        if item.get("type") == "text":
            parts.append(str(item.get("text", "")))
        else:
            parts.append(json.dumps(item))
    if not parts and result.get("structuredContent") is not None:
        parts.append(json.dumps(result["structuredContent"]))
    return "\n".join(parts)


async def _list_tools_page(session: ClientSession, cursor: str | None) -> Any:
    if cursor is None:
        return await session.list_tools()
    params = mcp_types.PaginatedRequestParams(cursor=cursor)
    return await session.list_tools(params=params)


class McpConnection:
    """A started MCP server and its initialised client session."""

    def __init__(self, name: str, config: McpServerConfig):
        self.name, self.config = name, config
        self._session: ClientSession | None = None
        self._ready: asyncio.Future[None] | None = None
        self._closing = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self.failure: str | None = None

    @property
    def alive(self) -> bool:
        return self._session is not None

    async def start(self, timeout: float) -> None:
        """Spawn the server and run the MCP handshake; raises McpToolError on any failure."""
        self._ready = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self._run(), name=f"mcp-{self.name}")
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            self._ready.cancel()  # nobody will read the runner's late outcome
            await self._end_runner(cancel=True)
            raise McpToolError(
                f"MCP server {self.name!r} did not initialise within {timeout:g}s") from None
        except Exception as exc:
            await self._end_runner(cancel=False)
            raise McpToolError(
                f"MCP server {self.name!r} failed to start: {describe(exc)}") from exc

    async def _run(self) -> None:
        assert self._ready is not None
        params = StdioServerParameters(command=self.config.command, args=self.config.args,
                                       env=self.config.env or None)
        try:
            async with stdio_client(params, errlog=sys.stderr) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    self._session = session
                    self._ready.set_result(None)
                    await self._closing.wait()
        except BaseException as exc:  # every way the server can end is reported
            self.failure = describe(exc)
            if not self._ready.done():
                self._ready.set_exception(exc if isinstance(exc, Exception)
                                          else McpToolError(self.failure))
            elif not self._closing.is_set():
                log.error("MCP server %r stopped: %s", self.name, self.failure)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._session = None

    async def list_tools(self) -> list[dict[str, Any]]:
        """The server's tools in MCP wire shape (`name`, `description`, `inputSchema`)."""
        session = self._require()
        tools: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = await _list_tools_page(session, cursor)
            tools += [t.model_dump(by_alias=True, exclude_none=True, mode="json")
                      for t in page.tools]
            cursor = getattr(page, "next_cursor", None) or getattr(page, "nextCursor", None)
            if not cursor:
                return tools

    async def call_tool(self, tool: str, arguments: dict[str, Any], timeout: float) -> str:
        """Run one tool; returns its text, raises McpToolError if it failed or timed out."""
        session = self._require()
        try:
            result = await asyncio.wait_for(session.call_tool(tool, arguments), timeout)
        except TimeoutError:
            raise McpToolError(f"tool {tool!r} of MCP server {self.name!r} timed out after "
                               f"{timeout:g}s") from None
        except Exception as exc:
            raise McpToolError(f"MCP server {self.name!r}: {describe(exc)}") from exc
        wire = result.model_dump(by_alias=True, mode="json")
        text = result_text(wire)
        if wire.get("isError"):
            raise McpToolError(text or f"tool {tool!r} failed")
        return text

    def _require(self) -> ClientSession:
        if self._session is None:
            reason = f": {self.failure}" if self.failure else ""
            raise McpToolError(f"MCP server {self.name!r} is not running{reason}")
        return self._session

    async def close(self) -> None:
        """End the session and the server process (idempotent)."""
        await self._end_runner(cancel=False)

    async def _end_runner(self, cancel: bool, timeout: float = 10.0) -> None:
        """Let the runner leave its contexts (which stops the server); cancel it if it is stuck
        (e.g. in a handshake the server never answers) or takes too long."""
        self._closing.set()
        runner = self._runner
        if runner is None or runner.done():
            return
        if not cancel:
            await asyncio.wait({runner}, timeout=timeout)
        if not runner.done():
            runner.cancel()
            await asyncio.wait({runner}, timeout=timeout)
