"""A response's output items, built from the text deltas of its turns, and the stream events that
tell a client about them (each with its `sequence_number`).

Rules:
- `response.output` is mutated in place as items grow; every event carries a copy, so an event
  is what was true when it was sent.
- Items open lazily in the order the model writes, one kind at a time: `reasoning` (one
  `reasoning_text` part), `message` (one `output_text` part), one call item per tool call. A
  change of kind (or a new call) completes the open item: `*.done` events, then
  `response.output_item.done`.
- A tool call whose name is an MCP tool of the request becomes an `mcp_call` item (its
  `server_label` and the tool's own name); its arguments are streamed like a function call's,
  but the item is completed only when the call has run (`mcp_done`: `response.mcp_call.
  completed` / `.failed`, then `output_item.done` with `output` or `error`). Any other call is
  a `function_call` item for the client to run.
- `finish` sets the status, usage and details and returns the terminal event
  (`response.completed` / `.incomplete` / `.failed`); a cancelled response sends none.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from flotilla.libs.common.messages import TextDelta
from flotilla.libs.common.tool_messages import McpToolRoute
from flotilla.services.gateway.responses.items import item_id, output_text_part
from flotilla.services.gateway.turns import UsageTotal

Event = dict[str, Any]
_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
             "failed": "response.failed"}


def usage_object(total: UsageTotal) -> dict[str, Any]:
    return {"input_tokens": total.prompt_tokens,
            "input_tokens_details": {"cached_tokens": total.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": total.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total.prompt_tokens + total.completion_tokens}


class ResponseOutput:
    """The output of one response and the events that built it."""

    def __init__(self, response: dict[str, Any], mcp_route: Callable[[str], McpToolRoute | None]):
        self.response = response
        self.output: list[dict[str, Any]] = response["output"]
        self.mcp_route = mcp_route
        self.seq = 0
        self._open: dict[str, Any] | None = None
        self._open_call: int | None = None  # the tool call index of an open call item
        self.turn_calls: list[dict[str, Any]] = []  # call items of the current turn
        self.exposed: dict[str, str] = {}  # call item id → the tool name the model called

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _snapshot(self, kind: str) -> Event:
        return self._event(kind, response=copy.deepcopy(self.response))

    def opening(self) -> list[Event]:
        return [self._snapshot("response.created"), self._snapshot("response.in_progress")]

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _start(self, item: dict[str, Any]) -> list[Event]:
        events = self.close_item()
        self.output.append(item)
        self._open = item
        events.append(self._event("response.output_item.added", output_index=self._index,
                                  item=copy.deepcopy(item)))
        if item["type"] in ("message", "reasoning"):
            part = (output_text_part("") if item["type"] == "message"
                    else {"type": "reasoning_text", "text": ""})
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self._index, content_index=0,
                                      part=copy.deepcopy(part)))
        return events

    def _done(self, item: dict[str, Any], index: int) -> Event:
        return self._event("response.output_item.done", output_index=index,
                           item=copy.deepcopy(item))

    def close_item(self) -> list[Event]:
        """Complete the open item (an mcp_call stays open until it has run)."""
        item, self._open, self._open_call = self._open, None, None
        if item is None:
            return []
        index, kind, events = self.output.index(item), item["type"], []
        where = {"item_id": item["id"], "output_index": index}
        if kind in ("message", "reasoning"):
            part = item["content"][0]
            if kind == "message":
                events.append(self._event("response.output_text.done", content_index=0,
                                          text=part["text"], logprobs=[], **where))
            else:
                events.append(self._event("response.reasoning_text.done", content_index=0,
                                          text=part["text"], **where))
            events.append(self._event("response.content_part.done", content_index=0,
                                      part=copy.deepcopy(part), **where))
        elif kind == "function_call":
            events.append(self._event("response.function_call_arguments.done",
                                      name=item["name"], arguments=item["arguments"], **where))
        else:
            events.append(self._event("response.mcp_call_arguments.done",
                                      arguments=item["arguments"], **where))
            return events
        item["status"] = "completed"
        events.append(self._done(item, index))
        return events

    def _text(self, kind: str, text: str) -> list[Event]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._start({"id": item_id("msg" if kind == "message" else "rs"),
                                   "type": kind, **({"role": "assistant"} if kind == "message"
                                                    else {"summary": []}),
                                   "status": "in_progress", "content": []})
        assert self._open is not None
        self._open["content"][0]["text"] += text
        delta_kind = ("response.output_text.delta" if kind == "message"
                      else "response.reasoning_text.delta")
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(delta_kind, item_id=self._open["id"], output_index=self._index,
                                  content_index=0, delta=text, **extra))
        return events

    def _call_item(self, index: int, call_id: str | None, name: str) -> dict[str, Any]:
        route = self.mcp_route(name)
        if route is not None:
            return {"id": item_id("mcp"), "type": "mcp_call", "server_label": route.server,
                    "name": route.tool, "arguments": "", "status": "in_progress"}
        return {"id": item_id("fc"), "type": "function_call",
                "call_id": call_id or item_id("call"), "name": name, "arguments": "",
                "status": "in_progress"}

    def delta(self, delta: TextDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.text:
            events += self._text("message", delta.text)
        for call in delta.tool_calls:
            if self._open_call != call.index:
                item = self._call_item(call.index, call.id, call.name or "")
                events += self._start(item)
                self._open_call = call.index
                self.turn_calls.append(item)
                self.exposed[item["id"]] = call.name or ""
            assert self._open is not None
            if call.arguments:
                self._open["arguments"] += call.arguments
                kind = ("response.mcp_call_arguments.delta" if self._open["type"] == "mcp_call"
                        else "response.function_call_arguments.delta")
                events.append(self._event(kind, item_id=self._open["id"],
                                          output_index=self._index, delta=call.arguments))
        return events

    def mcp_running(self, item: dict[str, Any]) -> Event:
        item["status"] = "calling"
        return self._event("response.mcp_call.in_progress", item_id=item["id"],
                           output_index=self.output.index(item))

    def mcp_done(self, item: dict[str, Any], output: str | None, error: str | None) -> list[Event]:
        index = self.output.index(item)
        if error is None:
            item.update(output=output, error=None, status="completed")
            kind = "response.mcp_call.completed"
        else:
            item.update(output=None, error=error, status="failed")
            kind = "response.mcp_call.failed"
        return [self._event(kind, item_id=item["id"], output_index=index),
                self._done(item, index)]

    def finish(self, status: str, usage: UsageTotal, incomplete: str | None = None,
               error: dict[str, str] | None = None) -> list[Event]:
        events = self.close_item()
        self.response.update(status=status, usage=usage_object(usage), error=error,
                             incomplete_details={"reason": incomplete} if incomplete else None)
        if status == "completed":
            self.response["completed_at"] = int(time.time())
        if status in _TERMINAL:
            events.append(self._snapshot(_TERMINAL[status]))
        return events

    def error_event(self, code: str, message: str, param: str | None) -> Event:
        return self._event("error", code=code, message=message, param=param)
