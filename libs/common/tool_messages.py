"""Typed messages of the tools service's subjects (`tools.list`, `tools.call`: subjects.py):
the MCP tools it offers and the calls the gateway has it run."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from flotilla.libs.common.messages import Message


class ToolsListRequest(Message):
    pass


class McpToolRoute(BaseModel):
    """Where an exposed tool name leads: the mcp.json server and the tool's own name there."""

    server: str
    tool: str


class ToolsListReply(Message):
    """OpenAI-shaped function tools (`{"type": "function", "function": {...}}`), named
    `server_tool`: `tools` are those offered to chat requests without `tools` (servers may opt
    out in mcp.json), `catalog` every tool of every running server, `routes` the server and
    tool behind each exposed name of either list."""

    tools: list[dict[str, Any]]
    errors: dict[str, str] = Field(default_factory=dict)
    catalog: list[dict[str, Any]] = Field(default_factory=list)
    routes: dict[str, McpToolRoute] = Field(default_factory=dict)


class ToolCallRequest(Message):
    """Run the tool exposed as `name`. `servers`: the only servers this call may reach (a
    request's allowlist); None = any configured server."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    servers: list[str] | None = None


class ToolCallReply(Message):
    ok: bool
    content: str = ""
    error: str | None = None
