"""MCP tools a request may use, and running one call through the tools service.

Rules:
- A Responses `mcp` tool names a server of mcp.json by `server_label` (a URL is refused: the
  gateway reaches only the servers its tools service was configured with); `allowed_tools`
  narrows that server's tools by their own names. `require_approval` must be `never` (absent
  counts as never): there is no approval flow, calls run as soon as the model makes them.
- Chat requests without `tools` get the injected tools (servers may opt out in mcp.json), and
  may call exactly those.
- A call goes to the tools service with the request's server allowlist (`servers`): the
  service refuses a call to any other server without contacting it. Arguments that are not a
  JSON object, a timeout, a missing tools service and a failing tool all become an error
  result for the model, never a failed request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from flotilla.libs.common import subjects
from flotilla.libs.common.errors import FlotillaError, invalid_request
from flotilla.libs.common.messages import ErrorInfo
from flotilla.libs.common.tool_messages import (
    McpToolRoute,
    ToolCallReply,
    ToolCallRequest,
    ToolsListReply,
)

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState


@dataclass
class McpToolset:
    """The MCP tools of one request: chat-shaped tools and where each name leads."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    routes: dict[str, McpToolRoute] = field(default_factory=dict)

    @property
    def servers(self) -> list[str]:
        return sorted({r.server for r in self.routes.values()})

    def route(self, name: str) -> McpToolRoute | None:
        return self.routes.get(name)


class CallOutcome(NamedTuple):
    output: str | None
    error: str | None


def _allowed(spec: dict[str, Any]) -> set[str] | None:
    allowed = spec.get("allowed_tools")
    if allowed is None:
        return None
    if isinstance(allowed, list):
        return set(allowed)
    return set(allowed.get("tool_names") or [])


def requested_toolset(tools: list[dict[str, Any]] | None, listing: ToolsListReply) -> McpToolset:
    """The `mcp` tools of a Responses request, checked against the tools service's listing."""
    toolset = McpToolset()
    configured = {r.server for r in listing.routes.values()} | set(listing.errors)
    by_name = {t["function"]["name"]: t for t in listing.catalog}
    for index, spec in enumerate(tools or []):
        if spec["type"] != "mcp":
            continue
        label = spec["server_label"]
        if label not in configured:
            known = ", ".join(sorted(configured)) or "none"
            raise invalid_request(f"MCP server `{label}` is not configured on this server "
                                  f"(configured: {known}).", param=f"tools[{index}].server_label")
        if label in listing.errors:  # 424 as OpenAI answers for an MCP server that fails
            raise FlotillaError(ErrorInfo(
                status=424, type="external_connector_error", param=f"tools[{index}].server_label",
                message=f"MCP server `{label}` is unavailable: {listing.errors[label]}"))
        allowed = _allowed(spec)
        for exposed, route in listing.routes.items():
            if route.server != label or (allowed is not None and route.tool not in allowed):
                continue
            if exposed in by_name and exposed not in toolset.routes:
                toolset.routes[exposed] = route
                toolset.tools.append(by_name[exposed])
    return toolset


def injected_toolset(listing: ToolsListReply) -> McpToolset:
    """The tools chat requests without `tools` are offered, and their routes."""
    names = {t["function"]["name"] for t in listing.tools}
    return McpToolset(list(listing.tools),
                      {n: r for n, r in listing.routes.items() if n in names})


def call_arguments(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the object MCP tools take; None when they are not one."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


async def run_call(gw: GatewayState, toolset: McpToolset, name: str,
                   arguments: str) -> CallOutcome:
    """Run the model's call of MCP tool `name` (see the module rules)."""
    args = call_arguments(arguments)
    if args is None:
        return CallOutcome(None, f"the arguments are not a JSON object: {arguments[:200]!r}")
    request = ToolCallRequest(name=name, arguments=args, servers=toolset.servers)
    try:
        reply = await gw.bus.request(subjects.TOOLS_CALL, request, ToolCallReply,
                                     timeout=gw.settings.mcp_call_timeout_s)
    except FlotillaError as exc:
        return CallOutcome(None, f"the tools service did not answer: {exc.info.message}")
    if not reply.ok:
        return CallOutcome(None, reply.error or "the tool failed")
    return CallOutcome(reply.content, None)
