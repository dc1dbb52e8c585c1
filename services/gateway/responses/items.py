"""Responses API items ⇄ chat messages: the input a client sends (and a stored chain) becomes
the chat conversation one turn renders; output items are built here too.

Rules:
- `input` as a string is one user message. Every input item is kept in its resource form (an
  `id`, a `status`, content parts typed `input_text` / `output_text`): that is what
  `/input_items` lists and what a later `previous_response_id` replays.
- Items → chat messages, in order: a message is a chat message of its role (text parts
  joined); a `reasoning` item's text becomes the `reasoning_content` of the next assistant
  message; consecutive calls (`function_call`, `mcp_call`) become the `tool_calls` of one
  assistant message (the preceding assistant text's, when it directly precedes them, as the
  model wrote them in one turn); a `function_call_output` is a tool message, and an executed
  `mcp_call`'s output (or error) is one right after its run of calls. This is the same
  conversation the agent loop built while generating, so a `previous_response_id` chain
  renders to the same prompt prefix (and hits the prefix cache).
"""

from __future__ import annotations

import uuid
from typing import Any


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _parts_text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content)


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(role: str, text: str, id: str | None = None) -> dict[str, Any]:
    if role == "assistant":
        parts = [output_text_part(text)]
    else:
        parts = [{"type": "input_text", "text": text}]
    return {"id": id or item_id("msg"), "type": "message", "role": role, "status": "completed",
            "content": parts}


def reasoning_item(text: str, id: str | None = None) -> dict[str, Any]:
    return {"id": id or item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as item resources (see the module rules)."""
    if isinstance(value, str):
        return [message_item("user", value)]
    out = []
    for item in value:
        kind = item.get("type", "message")
        if kind == "message":
            out.append(message_item(item["role"], _parts_text(item["content"]), item.get("id")))
        elif kind == "function_call":
            out.append({"id": item.get("id") or item_id("fc"), "type": "function_call",
                        "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            output = item["output"]
            out.append({"id": item.get("id") or item_id("fco"), "type": "function_call_output",
                        "call_id": item["call_id"],
                        "output": output if isinstance(output, str) else _parts_text(output),
                        "status": "completed"})
        elif kind == "reasoning":
            text = "".join(p["text"] for p in item.get("content") or [])
            if not text:
                text = "".join(p["text"] for p in item.get("summary") or [])
            out.append(reasoning_item(text, item.get("id")))
        else:  # mcp_call items of an earlier response, sent back as they were
            out.append(dict(item))
    return out


def _mcp_result(item: dict[str, Any]) -> str:
    if item.get("error"):
        return f"Error: {item['error']}"
    return str(item.get("output") or "")


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat conversation of `items` (see the module rules)."""
    messages: list[dict[str, Any]] = []
    reasoning = ""
    results: list[dict[str, Any]] = []  # executed MCP calls' outputs, after their run of calls

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if reasoning:
            message["reasoning_content"], reasoning = reasoning, ""
        messages.append(message)
        return message

    for item in items:
        kind = item["type"]
        if kind in ("function_call", "mcp_call"):
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = assistant()
            call_id = item["call_id"] if kind == "function_call" else item["id"]
            last.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
            if kind == "mcp_call":
                results.append({"role": "tool", "tool_call_id": call_id,
                                "content": _mcp_result(item)})
            continue
        messages.extend(results)
        results = []
        if kind == "reasoning":
            reasoning += "".join(p["text"] for p in item.get("content") or [])
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
        elif kind == "message" and item["role"] == "assistant":
            assistant()["content"] = _parts_text(item["content"])
        elif kind == "message":
            messages.append({"role": item["role"], "content": _parts_text(item["content"])})
    messages.extend(results)
    if reasoning:  # reasoning with nothing after it (cut short): keep it as an empty turn
        assistant()["content"] = ""
    return messages

