"""A validated Responses API request → what its turns run (a chat-completions body without the
messages, the client's function tools, extra TextRequest fields) and the response object it
starts as.

Rules:
- The chat body carries what chat completions spell the same way: temperature, top_p,
  parallel_tool_calls, tool_choice (`{"type": "function", "name"}` → the chat form);
  max_output_tokens bounds the whole response (every turn of the agent loop counts against it).
- `text.format` json_object / json_schema → the chat `response_format` (constrained decoding
  through the grammar path); `text` → none.
- `reasoning.effort` → the TextRequest's `reasoning_effort` (`none` also sets the template's
  `enable_thinking: false`); `reasoning.summary` is accepted: reasoning is returned as the
  reasoning item's full text, not summarised.
- Function tools keep their name, description and parameters; `mcp` tools are resolved
  against the tools service (mcp.py).
- `store` defaults to true (as OpenAI's); `metadata`, `user`, `safety_identifier`,
  `prompt_cache_key`, `service_tier` and `include` do not change what is generated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flotilla.services.gateway.plan import new_request_id


@dataclass
class ResponseRequest:
    rid: str
    body: dict[str, Any]  # the validated request
    chat: dict[str, Any]  # a chat-completions body without `messages`
    function_tools: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def response_id(self) -> str:
        return f"resp_{self.rid}"

    @property
    def store(self) -> bool:
        return self.body.get("store") is not False

    @property
    def conversation(self) -> str | None:
        """The id of the request's `conversation` (a string or `{id}`), if any."""
        value = self.body.get("conversation")
        return value["id"] if isinstance(value, dict) else value

    @property
    def background(self) -> bool:
        return bool(self.body.get("background"))

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def max_output_tokens(self) -> int | None:
        value = self.body.get("max_output_tokens")
        return None if value is None else int(value)


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice["type"] == "function":
            return {"type": "function", "function": {"name": choice["name"]}}
        if choice["type"] == "allowed_tools":
            return choice["mode"]
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema: dict[str, Any] = {"name": fmt["name"], "schema": fmt["schema"]}
    if fmt.get("strict") is not None:
        schema["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": schema}


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for tool in tools or []:
        if tool["type"] != "function":
            continue
        function: dict[str, Any] = {"name": tool["name"],
                                    "parameters": tool.get("parameters") or {"type": "object",
                                                                             "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def response_request(body: dict[str, Any]) -> ResponseRequest:
    chat: dict[str, Any] = {"model": body["model"]}
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    extra: dict[str, Any] = {}
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        extra["reasoning_effort"] = effort
        if effort == "none":
            chat["chat_template_kwargs"] = {"enable_thinking": False}
    return ResponseRequest(new_request_id(), body, chat, function_tools(body.get("tools")), extra)


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool["type"] == "function":
        return {"type": "function", "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"), "strict": tool.get("strict")}
    return dict(tool)


def response_object(req: ResponseRequest, status: str = "in_progress") -> dict[str, Any]:
    """The response as it starts (no output yet), echoing the request's settings."""
    body = req.body
    reasoning = body.get("reasoning") or {}
    text = dict(body.get("text") or {})
    text.setdefault("format", {"type": "text"})
    return {
        "id": req.response_id, "object": "response", "created_at": int(time.time()),
        "status": status, "background": req.background, "completed_at": None, "error": None,
        "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body["model"], "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "conversation": {"id": req.conversation} if req.conversation else None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": req.store, "temperature": body.get("temperature", 1.0), "text": text,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": [_echo_tool(t) for t in body.get("tools") or []],
        "top_p": body.get("top_p", 1.0), "truncation": body.get("truncation", "disabled"),
        "metadata": body.get("metadata") or {},
        **({"user": body["user"]} if body.get("user") else {}),
    }
