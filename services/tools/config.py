"""mcp.json: which MCP servers the tools service starts (the Claude Desktop file shape).

```json
{"mcpServers": {"weather": {"command": "uvx", "args": ["mcp-weather"], "env": {"KEY": "..."}}}}
```
Every entry is a stdio server: `command` is required, `args` and `env` are optional; flotilla's
own keys `inject` (false: not offered to chat requests without `tools`) and `allowedTools`
(expose only these tools) narrow what a server offers. A missing or
malformed file is a start-up error naming the file and the problem; a valid file with no servers
(or no file configured at all) means the service serves an empty tool list.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ToolsConfigError(ValueError):
    """The MCP configuration cannot be used; the message says which file and why."""


class McpServerConfig(BaseModel):
    """One stdio MCP server: the process to start and its extra environment.

    `inject` (flotilla's key, default true): offer this server's tools to chat requests that
    send no `tools`; false keeps them for requests that name the server (Responses `mcp`
    tools). `allowedTools`: only these tools of the server are exposed at all."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)  # Claude Desktop keys
    command: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    inject: bool = True
    allowed_tools: list[str] | None = Field(None, alias="allowedTools")


class McpConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    servers: dict[str, McpServerConfig] = Field(default_factory=dict, alias="mcpServers")


def load_mcp_config(path: Path | None) -> dict[str, McpServerConfig]:
    """Read and validate an mcp.json file; `None` means no MCP servers."""
    if path is None:
        return {}
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise ToolsConfigError(f"MCP config {path} does not exist (FLOTILLA_MCP_CONFIG)") from exc
    except OSError as exc:
        raise ToolsConfigError(f"MCP config {path} cannot be read: {exc}") from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolsConfigError(f"MCP config {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or "mcpServers" not in raw:
        raise ToolsConfigError(
            f'MCP config {path} must be an object with an "mcpServers" map, '
            '{"mcpServers": {"name": {"command": ..., "args": [...], "env": {...}}}}'
        )
    try:
        return McpConfig.model_validate(raw).servers
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ToolsConfigError(f"MCP config {path} is invalid: {problems}") from exc
