"""Chat history as clients send it back → the messages the tokenizer renders.

SDKs append the response message they got to the next request's history, with every field it
had; a field that only describes an earlier output never changes what the model reads, so it is
accepted and dropped here. Rules:
- dropped: `id`, `parsed` (the SDK's `parse()`), `annotations`, `audio: null`,
  `function_call: null`, null or empty `tool_calls`, null reasoning; `tool_calls[].index` (the
  stream helper's) and `tool_calls[].function.parsed_arguments` (`parse()` with tools);
- `refusal`: an assistant turn whose only text is its refusal reads as that text (what the
  user saw); refusal content parts likewise; this server's `mcp_calls` (executed MCP calls)
  are dropped like the other output fields;
- content-part arrays (text parts, refusal parts) are joined with newlines into one string;
- reasoning sent back as `reasoning` reaches templates as `reasoning_content`;
- legacy function calling: an assistant `function_call: {name, arguments}` becomes a tool call
  with id `call_<message index>`, and a `function` message (`name`, `content`) the tool message
  answering the latest such call of that name (a result with no such call, as in a
  history the client trimmed, gets an id of its own: `call_<its index>`).
The spec has checked the shapes (image, audio and file parts are refused there, by name).
"""

from __future__ import annotations

from typing import Any

_OUTPUT_ONLY = ("id", "parsed", "refusal", "annotations", "audio", "function_call",
                "mcp_calls")


def _text(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    return "\n".join(part["text"] if part["type"] == "text" else part["refusal"]
                     for part in content)


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"id": call["id"], "type": call.get("type", "function"),
            "function": {"name": function["name"], "arguments": function["arguments"]}}


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """One message without its output-only fields (see the module rules; legacy function
    messages need the whole history: `normalize_messages`)."""
    out = {k: v for k, v in message.items() if k not in _OUTPUT_ONLY}
    if "content" in out:
        out["content"] = _text(out["content"])
    refusal = message.get("refusal")
    if message.get("role") == "assistant" and not out.get("content") and isinstance(refusal, str):
        out["content"] = refusal
    if out.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c) for c in out["tool_calls"]]
    else:
        out.pop("tool_calls", None)
        if out.get("role") == "assistant" and out.get("content") is None:
            out["content"] = ""  # content null without tool calls (as responses carry it)
    reasoning = out.pop("reasoning", None)
    if out.get("reasoning_content") is None:
        out.pop("reasoning_content", None)
        if isinstance(reasoning, str):
            out["reasoning_content"] = reasoning
    return out


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The whole history, legacy function calls turned into tool calls (module rules)."""
    out: list[dict[str, Any]] = []
    open_calls: dict[str, str] = {}  # function name → id of its latest legacy call
    for i, message in enumerate(messages):
        if message["role"] == "function":
            # a result without a call (history trimmed by the client) keeps its own id
            call_id = open_calls.pop(message["name"], None) or f"call_{i}"
            out.append({"role": "tool", "tool_call_id": call_id, "name": message["name"],
                        "content": message.get("content") or ""})
            continue
        new = normalize_message(message)
        call = message.get("function_call")
        if message["role"] == "assistant" and isinstance(call, dict):
            call_id = f"call_{i}"
            new["tool_calls"] = [*new.get("tool_calls", []), {
                "id": call_id, "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]}}]
            open_calls[call["name"]] = call_id
        out.append(new)
    return out
