"""MCP tool injection: which tools a chat request offers the model.

Rules:
- A request with its own `tools` keeps them; `tools: []` opts out (no tools at all).
- A request without `tools` (absent or null) gets the tools service's list. No tools service, a
  slow one, or a broken reply means no tools: tool injection never fails a request.
"""

from __future__ import annotations

import logging
from typing import Any

from libs.common import subjects
from libs.common.bus import Bus
from libs.common.errors import FlotillaError
from libs.common.messages import ToolsListReply, ToolsListRequest

log = logging.getLogger(__name__)


async def mcp_tools(bus: Bus, timeout_s: float) -> list[dict[str, Any]]:
    """The tools service's function tools, or [] when none answers within `timeout_s`."""
    try:
        reply = await bus.request(subjects.TOOLS_LIST, ToolsListRequest(), ToolsListReply,
                                  timeout=timeout_s)
    except FlotillaError as exc:
        log.debug("no MCP tools: %s", exc)
        return []
    except Exception as exc:  # a malformed reply must not fail the user's request
        log.warning("tools service reply unusable: %s", exc)
        return []
    for server, error in reply.errors.items():
        log.info("MCP server %s unavailable: %s", server, error)
    return list(reply.tools)


async def tools_for(body: dict[str, Any], bus: Bus,
                    timeout_s: float) -> list[dict[str, Any]] | None:
    """The tools to send with a chat request (None = no tools)."""
    own = body.get("tools")
    if own is not None:
        return list(own) or None
    return await mcp_tools(bus, timeout_s) or None
