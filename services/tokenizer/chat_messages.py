"""Chat messages as templates need them: checked for meaning, normalized to one shape.

The gateway validates the shape against the OpenAPI spec; this module checks what a template
relies on and turns violations into 400s that name the offending field (`param`):
- roles: system, user, assistant, tool, developer (`developer` is rendered as `system`, the role
  every template knows);
- content: a string or a list of text parts (joined with newlines); other part types are refused;
- assistant messages carry content or tool calls; tool-call arguments are JSON text, handed to the
  template as objects (HF convention: templates write `arguments | tojson`);
- tool messages name the `tool_call_id` of a tool call made earlier in the conversation.
The input is never modified; `normalize_messages` returns new dicts.
"""

from __future__ import annotations

import json
from typing import Any

from flotilla.libs.common.errors import FlotillaError, invalid_request

ROLES = ("system", "user", "assistant", "tool", "developer")


def _bad(message: str, param: str) -> FlotillaError:
    return invalid_request(message, param=param, code="invalid_value")


def _content_text(content: Any, param: str, required: bool) -> str | None:
    if content is None:
        if required:
            raise _bad(f"{param} is required for this role", param)
        return None
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise _bad(f"{where}: only text content parts are supported by this model "
                       f"(got type {kind!r})", f"{where}.type")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.text must be a string", f"{where}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise _bad(f"{param} must be a list", param)
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{where}.function.name must be a non-empty string", f"{where}.function")
        if call.get("type", "function") != "function":
            raise _bad(f"{where}.type must be 'function'", f"{where}.type")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise _bad(f"{where}.function.arguments is not valid JSON: {exc.msg}",
                           f"{where}.function.arguments") from None
        if not isinstance(args, dict):
            raise _bad(f"{where}.function.arguments must encode a JSON object",
                       f"{where}.function.arguments")
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked, template-ready copies of OpenAI chat messages (see module rules)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    seen_call_ids: set[str] = set()
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(f"{param} must be an object", param)
        role = msg.get("role")
        if role not in ROLES:
            raise _bad(f"{param}.role must be one of {', '.join(ROLES)} (got {role!r})",
                       f"{param}.role")
        if "name" in msg and not isinstance(msg["name"], str):
            raise _bad(f"{param}.name must be a string", f"{param}.name")
        new = dict(msg)
        new["role"] = "system" if role == "developer" else role
        has_calls = role == "assistant" and bool(msg.get("tool_calls"))
        text = _content_text(msg.get("content"), f"{param}.content",
                             required=role != "assistant")
        if role == "assistant":
            if text is None and not has_calls:
                raise _bad(f"{param}: an assistant message needs content or tool_calls",
                           f"{param}.content")
            if has_calls:
                new["tool_calls"] = _tool_calls(msg["tool_calls"], f"{param}.tool_calls")
                seen_call_ids.update(c["id"] for c in new["tool_calls"]
                                     if isinstance(c.get("id"), str))
            else:
                new.pop("tool_calls", None)
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{param}.tool_call_id is required for tool messages",
                           f"{param}.tool_call_id")
            if call_id not in seen_call_ids:
                raise _bad(f"{param}.tool_call_id {call_id!r} does not answer a tool call of an "
                           "earlier assistant message", f"{param}.tool_call_id")
        new["content"] = text if text is not None else ""
        out.append(new)
    return out
