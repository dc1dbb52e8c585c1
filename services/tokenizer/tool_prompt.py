"""Making tools, and earlier tool calls, visible to a model whose chat template ignores them.

A template that never reads the `tools` variable would silently drop the request's tools. Then the
tool descriptions (their JSON schemas) and the calling convention are written into the system
message instead (after the existing system text, or as a new first message), in the Hermes/Qwen
style that the tool-call parser understands:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that does not render `tool_calls` would likewise drop the calls of earlier assistant
turns: `inline_tool_history` writes them into the assistant's content in the model's format, and
turns tool results into user turns wrapped in `<tool_response>` (consecutive results share one).
"""

from __future__ import annotations

import json
from typing import Any

from flotilla.libs.common.errors import invalid_request
from flotilla.services.tokenizer.tool_formats import ToolFormat

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
                 tool_choice: Any = None, as_system: bool = True) -> list[dict[str, Any]]:
    """Messages with the tool section in the system message (messages are already normalized:
    content is a string); `as_system` false: in front of the first user message instead, for
    templates that refuse a system turn."""
    section = tools_text(tools, tool_choice)
    if as_system:
        if messages and messages[0].get("role") == "system":
            text = messages[0]["content"]
            first = {**messages[0], "content": f"{text}\n\n{section}" if text else section}
            return [first, *messages[1:]]
        return [{"role": "system", "content": section}, *messages]
    for i, msg in enumerate(messages):
        if msg.get("role") == "user":
            first = {**msg, "content": f"{section}\n\n{msg['content']}"}
            return [*messages[:i], first, *messages[i + 1:]]
    return [{"role": "user", "content": section}, *messages]


def inline_tool_history(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """Normalized messages with tool calls and tool results written as text (see above)."""
    out: list[dict[str, Any]] = []
    merge = False  # the last message is a user turn made of tool results
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = [(c["function"]["name"],
                      json.dumps(c["function"]["arguments"], ensure_ascii=False))
                     for c in msg["tool_calls"]]
            text = fmt.calls_text(calls)
            new = {k: v for k, v in msg.items() if k != "tool_calls"}
            new["content"] = f"{msg['content']}\n{text}" if msg["content"] else text
            out.append(new)
            merge = False
        elif msg["role"] == "tool":
            block = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if merge:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
            merge = True
        else:
            out.append(msg)
            merge = False
    return out
