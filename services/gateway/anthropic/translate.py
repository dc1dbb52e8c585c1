"""An Anthropic Messages request (validated against the spec) → the chat-completions body that
serves it, plus the TextRequest fields chat bodies do not spell.

Rules:
- `system` (a string or text blocks; `cache_control` accepted and ignored: the engine's prefix
  cache needs no hints) becomes the first message, role system.
- A user message's `tool_result` blocks become chat `tool` messages (in order, before the rest
  of that message's text); `is_error` results are prefixed with "Error: " so the model sees it.
- An assistant message's text blocks become its content, `tool_use` blocks its `tool_calls`
  (the input as JSON text), `thinking` blocks its reasoning (`reasoning_content`);
  `redacted_thinking` carries nothing we can read and is dropped.
- A last message from the assistant is a prefill: the reply continues it
  (`continue_final_message`, no generation prompt).
- tools: `input_schema` is the function's parameters. tool_choice auto / any / tool / none →
  auto / required / the named function / none; `disable_parallel_tool_use` → at most one call.
- thinking: `enabled` with `budget_tokens` → reasoning effort low (< 4,096), medium (< 16,384)
  or high; `disabled` → effort none and the template's `enable_thinking: false`; `adaptive`
  leaves it to the model. `output_config.effort` (xhigh and max = high) overrides the budget;
  `output_config.format` (a JSON schema) becomes the chat `response_format`.
- max_tokens → max_completion_tokens; stop_sequences → stop; temperature, top_p, top_k pass
  through; `metadata`, `cache_control`, `service_tier`, `speed` and `inference_geo` do not change
  what is generated and are dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


@dataclass
class ChatShape:
    """What a translated request runs: a chat-completions body and extra TextRequest fields."""

    body: dict[str, Any]
    tools: list[dict[str, Any]] | None
    extra: dict[str, Any] = field(default_factory=dict)


def _text(blocks: str | list[dict[str, Any]]) -> str:
    if isinstance(blocks, str):
        return blocks
    return "\n".join(b["text"] for b in blocks if b.get("type") == "text")


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    text = "" if content is None else _text(content)
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _user(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out = [_tool_result(b) for b in content if b["type"] == "tool_result"]
    texts = [b["text"] for b in content if b["type"] == "text"]
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(content: str | list[dict[str, Any]]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message: dict[str, Any] = {"role": "assistant",
                               "content": "".join(b["text"] for b in content
                                                  if b["type"] == "text")}
    calls = [{"id": b["id"], "type": "function",
              "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
             for b in content if b["type"] == "tool_use"]
    if calls:
        message["tool_calls"] = calls
        message["content"] = message["content"] or None
    thinking = "".join(b["thinking"] for b in content if b["type"] == "thinking")
    if thinking:
        message["reasoning_content"] = thinking
    return message


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text(system)})
    for m in body["messages"]:
        if m["role"] == "user":
            messages.extend(_user(m["content"]))
        else:
            messages.append(_assistant(m["content"]))
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        function: dict[str, Any] = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description"):
            function["description"] = t["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> Any:
    if choice is None:
        return None
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def reasoning_effort(thinking: dict[str, Any] | None, effort: str | None) -> str | None:
    if thinking is not None and thinking["type"] == "disabled":
        return "none"
    if effort is not None:
        return _EFFORT[effort]
    if thinking is None or thinking["type"] == "adaptive":
        return None
    budget = int(thinking["budget_tokens"])
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"


def _response_format(output_config: dict[str, Any]) -> dict[str, Any] | None:
    fmt = output_config.get("format")
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_shape(body: dict[str, Any]) -> ChatShape:
    """The chat-completions body (and extras) of a validated Messages request."""
    messages = chat_messages(body)
    tools = chat_tools(body.get("tools"))
    chat: dict[str, Any] = {"model": body["model"], "messages": messages,
                            "stream": bool(body.get("stream"))}
    if body.get("max_tokens") is not None:
        chat["max_completion_tokens"] = body["max_tokens"]
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences"):
        chat["stop"] = list(body["stop_sequences"])
    choice = body.get("tool_choice")
    if choice is not None:  # any / tool without tools: chat_plan refuses it, naming tool_choice
        chat["tool_choice"] = _tool_choice(choice)
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    output_config = body.get("output_config") or {}
    response_format = _response_format(output_config)
    if response_format is not None:
        chat["response_format"] = response_format
    extra: dict[str, Any] = {}
    effort = reasoning_effort(body.get("thinking"), output_config.get("effort"))
    if effort is not None:
        extra["reasoning_effort"] = effort
        if effort == "none":
            chat["chat_template_kwargs"] = {"enable_thinking": False}
    if body["messages"] and body["messages"][-1]["role"] == "assistant":
        extra.update(continue_final_message=True, add_generation_prompt=False)
    return ChatShape(chat, tools, extra)
