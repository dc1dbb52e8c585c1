"""Legacy function calling (`functions` / `function_call`, OpenAI's API before tools) and the
`allowed_tools` tool choice, both mapped onto tools.

Rules:
- request: `functions` become function tools and `function_call` the tool choice (`none`,
  `auto`, or `{"name"}` → a named function). A reply makes at most one call, as OpenAI's legacy
  API does (`parallel_tool_calls: true` beside `functions` is a 400). Sending `functions` with
  `tools`, or `function_call` with `tool_choice`, is a 400 naming the legacy field.
- response (requests that sent `functions`): as OpenAI answers them, the call is
  `message.function_call: {name, arguments}` (streamed as `delta.function_call` pieces) with
  `finish_reason: "function_call"`, and no `tool_calls`.
- `tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}` offers only the
  named tools, with `mode` (`auto` or `required`) as the choice; a name that is not among the
  tools is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from flotilla.libs.common.errors import invalid_request
from flotilla.libs.common.messages import ToolCallDelta


def from_legacy(body: dict[str, Any]) -> dict[str, Any]:
    """The body with `functions` / `function_call` as `tools` / `tool_choice` (module rules)."""
    functions, call = body.get("functions"), body.get("function_call")
    if functions is None and call is None:
        return body
    out = dict(body)
    if functions is not None:
        if body.get("tools") is not None:
            raise invalid_request("`functions` and `tools` cannot both be sent; `functions` is "
                                  "the deprecated spelling of `tools`.", param="functions")
        if body.get("parallel_tool_calls"):
            raise invalid_request("`parallel_tool_calls` cannot be true with `functions`: a "
                                  "legacy function-calling reply makes at most one call.",
                                  param="parallel_tool_calls")
        out["tools"] = [{"type": "function", "function": f} for f in functions]
        out["parallel_tool_calls"] = False
    if call is not None:
        if body.get("tool_choice") is not None:
            raise invalid_request("`function_call` and `tool_choice` cannot both be sent; "
                                  "`function_call` is the deprecated spelling of `tool_choice`.",
                                  param="function_call")
        out["tool_choice"] = call if isinstance(call, str) else {
            "type": "function", "function": {"name": call["name"]}}
    return out


def allowed_tools(tools: list[dict[str, Any]] | None,
                  choice: Any) -> tuple[list[dict[str, Any]] | None, Any]:
    """(tools, tool_choice) with an `allowed_tools` choice resolved (module rules)."""
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return tools, choice
    spec = choice["allowed_tools"]
    by_name = {t["function"]["name"]: t for t in tools or []}
    chosen = []
    for i, ref in enumerate(spec["tools"]):
        name = ref["function"]["name"]
        if name not in by_name:
            raise invalid_request(
                f"`tool_choice.allowed_tools` names the function `{name}`, which is not among "
                "the tools.", param=f"tool_choice.allowed_tools.tools[{i}].function.name")
        chosen.append(by_name[name])
    return chosen, spec["mode"]


def function_call(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A legacy reply's `message.function_call` from its (single) tool call."""
    function = calls[0]["function"]
    return {"name": function["name"], "arguments": function["arguments"]}


def function_call_delta(calls: list[ToolCallDelta]) -> dict[str, Any]:
    """A streamed legacy call piece (the name first, then argument fragments) from a delta's
    pieces of its one call."""
    out: dict[str, Any] = {"arguments": "".join(c.arguments for c in calls)}
    name = next((c.name for c in calls if c.name is not None), None)
    if name is not None:
        out["name"] = name
    return out
