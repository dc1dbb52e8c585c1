"""Making tools visible to a model whose chat template ignores `tools`.

A template that never reads the `tools` variable would silently drop the request's tools. Then the
tool descriptions (their JSON schemas) and the calling convention are written into the system
message instead (after the existing system text, or as a new first message), in the Hermes/Qwen
style that the tool-call parser understands:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
from typing import Any

from libs.common.errors import invalid_request

_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_FOOTER = (
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid_request(f"tools[{i}].function.name must be a non-empty string",
                                  param=f"tools[{i}].function.name", code="invalid_value")
        if fn["name"] in names:
            raise invalid_request(f"tools[{i}]: duplicate function name {fn['name']!r}",
                                  param=f"tools[{i}].function.name", code="invalid_value")
        names.append(fn["name"])
    return names


def forced_function(tool_choice: Any, names: list[str]) -> str | None:
    """The function `tool_choice` forces, checked against the request's tools."""
    if not isinstance(tool_choice, dict):
        return None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in names:
        raise invalid_request(f"tool_choice names function {name!r}, which is not in tools",
                              param="tool_choice", code="invalid_value")
    return str(name)


def tools_text(tools: list[dict[str, Any]], tool_choice: Any = None) -> str:
    """The tool section of a system prompt: schemas, calling convention, tool_choice rule."""
    names = tool_names(tools)
    lines = [_HEADER]
    lines += [json.dumps(tool, ensure_ascii=False) for tool in tools]
    lines.append(_FOOTER)
    if (forced := forced_function(tool_choice, names)) is not None:
        lines.append(f"\nYou must call the function `{forced}`.")
    elif tool_choice == "required":
        lines.append("\nYou must call at least one function.")
    return "\n".join(lines)


def inject_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 tool_choice: Any = None) -> list[dict[str, Any]]:
    """Messages with the tool section in the system message (messages are already normalized:
    content is a string)."""
    section = tools_text(tools, tool_choice)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{section}" if first["content"] else section
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]
