"""Text deltas of one turn → Anthropic's stream events (`event: <type>` + `data: <json>`).

Rules:
- The stream is `message_start` (an empty message; input tokens are not known before the
  final frame, so its usage is zeros), `ping`, then content blocks, each
  `content_block_start` → `content_block_delta`s → `content_block_stop`, then `message_delta`
  (stop_reason, stop_sequence and the whole usage, input tokens included: the SDK's
  accumulator takes every count it carries) and `message_stop`.
- Blocks open lazily, in the order the model writes: a `thinking` block (thinking_delta; a
  signature_delta just before it closes), a `text` block (text_delta), one `tool_use` block per
  call (its id and name at the start, `input_json_delta` argument fragments). A change of kind
  (or a new call) closes the open block. A reply with no block at all gets one empty text block,
  as `message.content_blocks` does.
- A failure after the first byte is one `error` event in Anthropic's envelope, and the stream
  ends (Anthropic streams have no `[DONE]`).
"""

from __future__ import annotations

from typing import Any

import orjson

from flotilla.libs.common.messages import ErrorInfo, TextDelta, TextFinal
from flotilla.services.gateway.anthropic.errors import anthropic_envelope
from flotilla.services.gateway.anthropic.message import (
    message_id,
    signature,
    stop_reason,
    stop_sequence,
    tool_use_id,
    usage,
)
from flotilla.services.gateway.turns import UsageTotal


def event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class MessageEvents:
    """The events of one streamed message."""

    def __init__(self, rid: str, model: str):
        self.rid, self.model = rid, model
        self.index = -1
        self._open: str | None = None  # "thinking", "text" or "tool:<call index>"
        self._thinking = ""

    def start(self) -> list[bytes]:
        zero = usage(UsageTotal())
        message: dict[str, Any] = {
            "id": message_id(self.rid), "type": "message", "role": "assistant",
            "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": zero}
        return [event({"type": "message_start", "message": message}), event({"type": "ping"})]

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close_block()
        self.index += 1
        self._open = kind
        out.append(event({"type": "content_block_start", "index": self.index,
                          "content_block": block}))
        return out

    def _close_block(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":
            out.append(self._delta({"type": "signature_delta",
                                    "signature": signature(self._thinking)}))
        out.append(event({"type": "content_block_stop", "index": self.index}))
        self._open = None
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, delta: TextDelta) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning:
            if self._open != "thinking":
                out += self._open_block("thinking", {"type": "thinking", "thinking": "",
                                                     "signature": ""})
            self._thinking += delta.reasoning
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.text:
            if self._open != "text":
                out += self._open_block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta.text}))
        for call in delta.tool_calls:
            kind = f"tool:{call.index}"
            if self._open != kind:
                out += self._open_block(kind, {
                    "type": "tool_use", "id": tool_use_id(call.id or "", self.rid, call.index),
                    "name": call.name or "", "input": {}})
            if call.arguments:
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": call.arguments}))
        return out

    def final(self, final: TextFinal) -> list[bytes]:
        out = []
        if self.index < 0:
            out += self._open_block("text", {"type": "text", "text": ""})
        out += self._close_block()
        total = UsageTotal()
        total.add(final.usage)
        out.append(event({"type": "message_delta",
                          "delta": {"stop_reason": stop_reason(final),
                                    "stop_sequence": stop_sequence(final)},
                          "usage": usage(total)}))
        out.append(event({"type": "message_stop"}))
        return out

    @staticmethod
    def error(info: ErrorInfo) -> bytes:
        return event(anthropic_envelope(info))
