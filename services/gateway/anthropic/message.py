"""A finished turn → Anthropic's `message` object, and the pieces stream events share with it.

Rules:
- Content blocks come in the order the model wrote them: `thinking` (with a `signature`), then
  `text`, then one `tool_use` per call. A text block is present even when empty unless the
  reply is tool calls or thinking only (Anthropic sends no empty text block then).
- stop_reason: the model's end → `end_turn` (`stop_sequence` when a stop sequence matched),
  max_tokens → `max_tokens`, tool calls → `tool_use`. An engine abort (shutdown) is `end_turn`.
- usage: `input_tokens` counts the prompt tokens not read from the prefix cache,
  `cache_read_input_tokens` those that were (Anthropic's split: their sum is the prompt).
- A thinking block's `signature` is a digest of its text: clients must send it back unchanged,
  and it lets nobody mistake edited thinking for ours (we do not reject edited thinking).
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from flotilla.libs.common.messages import TextFinal
from flotilla.services.gateway.results import ChoiceResult
from flotilla.services.gateway.turns import UsageTotal

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
         "abort": "end_turn"}


def message_id(rid: str) -> str:
    return f"msg_{rid}"


def tool_use_id(call_id: str, rid: str, index: int) -> str:
    return call_id or f"toolu_{rid}_{index}"


def stop_reason(final: TextFinal) -> str:
    if final.finish_reason == "stop" and final.stop_string is not None:
        return "stop_sequence"
    return _STOP[final.finish_reason]


def stop_sequence(final: TextFinal) -> str | None:
    """The stop sequence that ended the message (Anthropic's `stop_sequence`)."""
    return final.stop_string if final.finish_reason == "stop" else None


def usage(total: UsageTotal) -> dict[str, Any]:
    return {"input_tokens": total.prompt_tokens - total.cached_tokens,
            "output_tokens": total.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": total.cached_tokens}


def signature(thinking: str) -> str:
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; text that is not a JSON object
    (a model's malformed call) is kept under `_raw_arguments` rather than lost."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def content_blocks(result: ChoiceResult, rid: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if result.reasoning:
        blocks.append({"type": "thinking", "thinking": result.reasoning,
                       "signature": signature(result.reasoning)})
    if result.text or not (result.tool_calls or result.reasoning):
        blocks.append({"type": "text", "text": result.text})
    for index, call in sorted(result.tool_calls.items()):
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"], rid, index),
                       "name": call["name"], "input": tool_input(call["arguments"])})
    return blocks


def message(rid: str, model: str, result: ChoiceResult) -> dict[str, Any]:
    assert result.final is not None
    total = UsageTotal()
    total.add(result.final.usage)
    return {"id": message_id(rid), "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(result, rid), "stop_reason": stop_reason(result.final),
            "stop_sequence": stop_sequence(result.final), "usage": usage(total)}
