"""Chat completions in a conversation kept by the server (an extension: the request's
`conversation`, a conversation id).

Rules:
- The conversation's items, rendered as chat messages the way `/v1/responses` renders them
  (responses/items.py), come before the request's `messages`.
- When the reply is complete (streamed or not), the request's messages and the reply (its
  reasoning, text and tool calls) are added to the conversation as items; a failed or
  cancelled request adds nothing.
- `n` must be 1 (a conversation has one reply per turn), else a 400 naming `n`. The server's
  MCP tools are not run in a conversation (the route refuses that combination: 400).
- The conversation must have room for the request's messages before anything runs (400
  naming `conversation`); the reply is checked again when it is added.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from flotilla.libs.common.errors import invalid_request
from flotilla.services.gateway.conversations.store import ConversationStore
from flotilla.services.gateway.responses.items import (
    chat_messages,
    item_id,
    message_item,
    reasoning_item,
)
from flotilla.services.gateway.results import ChoiceResult

AfterReply = Callable[[list[ChoiceResult], str], Awaitable[None]]


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part["text"] for part in content)  # the spec allows text parts only


def message_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as conversation items (the inverse of `items.chat_messages`)."""
    items: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        text = _text(message.get("content"))
        if role == "tool":
            items.append({"id": item_id("fco"), "type": "function_call_output",
                          "call_id": message.get("tool_call_id") or "", "output": text,
                          "status": "completed"})
            continue
        if role != "assistant":
            items.append(message_item(role, text))
            continue
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            items.append(reasoning_item(reasoning))
        if text or not message.get("tool_calls"):
            items.append(message_item("assistant", text))
        for call in message.get("tool_calls") or []:
            items.append({"id": item_id("fc"), "type": "function_call", "call_id": call["id"],
                          "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def reply_items(result: ChoiceResult, call_ids: list[str]) -> list[dict[str, Any]]:
    """The reply of one choice as conversation items; `call_ids` name its tool calls in order
    (the ids the client was sent)."""
    items = []
    if result.reasoning:
        items.append(reasoning_item(result.reasoning))
    calls = [c for _, c in sorted(result.tool_calls.items())]
    if result.text or not calls:
        items.append(message_item("assistant", result.text))
    for call, call_id in zip(calls, call_ids, strict=True):
        items.append({"id": item_id("fc"), "type": "function_call", "call_id": call_id,
                      "name": call["name"], "arguments": call["arguments"],
                      "status": "completed"})
    return items


async def in_conversation(store: ConversationStore, body: dict[str, Any]
                          ) -> tuple[dict[str, Any], AfterReply]:
    """The body with the conversation's messages first (and no `conversation`), and what adds
    the messages and the reply (of the request `rid`) to the conversation once it is complete."""
    conversation = body["conversation"]
    history = (await store.get(conversation, "conversation"))["items"]
    if int(body.get("n") or 1) != 1:
        raise invalid_request("A request in a `conversation` must have `n: 1`.", param="n")
    new = message_items(body["messages"])
    store.check(history + new, "conversation")
    body = {k: v for k, v in body.items() if k != "conversation"}
    body["messages"] = chat_messages(history) + body["messages"]

    async def after(results: list[ChoiceResult], rid: str) -> None:
        result = results[0]
        if result.final is None:
            return
        ids = [c["id"] or f"call_{rid}_0_{k}" for k, c in sorted(result.tool_calls.items())]
        await store.append(conversation, new + reply_items(result, ids), "conversation")

    return body, after
