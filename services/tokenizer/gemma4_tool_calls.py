"""Gemma 4's tool calls: `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`, with values written
as its chat template writes them — strings between `<|"|>` quotes, `true` / `false`, numbers,
`{key:VALUE,...}` objects (keys bare or quoted) and `[VALUE,...]` lists.

Rules as tool_calls.py: text outside calls is content; a candidate call (from `<|tool_call>`)
is held back until its name is complete (`call:NAME{`), committed when NAME is one of the
request's tools, else passed through as content; its arguments are sent as JSON once the call
closes (`}<tool_call|>`: the first that ends a well-formed object), or with what parses when
the reply ends inside it (`{}` if nothing does: a call that never closes runs to the end of the
reply); a name not complete within MAX_NAME characters is not a call; whitespace-only text
before the first call, between calls and after the last is dropped; with `parallel` false
calls after the first are dropped; the output concatenated is the same for every split of the
reply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from flotilla.libs.common.messages import ToolCallDelta
from flotilla.services.tokenizer.call_stream import CallStream, openai_call_id

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_NAME = re.compile(r"call:([A-Za-z0-9_.\-]+)\{")
_NAME_PREFIX = re.compile(r"(c(a(l(l(:[A-Za-z0-9_.\-]*)?)?)?)?)?")
_SCALAR_END = ",}]"
MAX_NAME = 256


class GemmaSyntaxError(ValueError):
    pass


def parse_value(text: str, pos: int = 0) -> tuple[Any, int]:
    """One value written in Gemma 4's syntax at `pos`: the value and the position after it."""
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        if end < 0:
            raise GemmaSyntaxError("unclosed string")
        return text[pos + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", pos):
        return parse_object(text, pos + 1)
    if text.startswith("[", pos):
        items: list[Any] = []
        pos += 1
        while not text.startswith("]", pos):
            item, pos = parse_value(text, pos)
            items.append(item)
            if text.startswith(",", pos):
                pos += 1
            elif not text.startswith("]", pos):
                raise GemmaSyntaxError("expected , or ]")
        return items, pos + 1
    end = pos
    while end < len(text) and text[end] not in _SCALAR_END:
        end += 1
    if end == len(text):
        raise GemmaSyntaxError("unterminated value")
    raw = text[pos:end].strip()
    if raw in ("None", "null"):
        return None, end
    try:
        return json.loads(raw), end  # true, false, numbers
    except json.JSONDecodeError:
        return raw, end


def parse_object(text: str, pos: int) -> tuple[dict[str, Any], int]:
    """An object's members after its `{`, through its `}`."""
    out: dict[str, Any] = {}
    while not text.startswith("}", pos):
        if text.startswith(QUOTE, pos):
            key, pos = parse_value(text, pos)
        else:
            colon = text.find(":", pos)
            if colon < 0:
                raise GemmaSyntaxError("expected key:")
            key, pos = text[pos:colon], colon
        if not text.startswith(":", pos):
            raise GemmaSyntaxError("expected :")
        out[str(key)], pos = parse_value(text, pos + 1)
        if text.startswith(",", pos):
            pos += 1
        elif not text.startswith("}", pos):
            raise GemmaSyntaxError("expected , or }")
    return out, pos + 1


def write_value(value: Any) -> str:
    """`value` as Gemma 4's template writes it (the inverse of `parse_value`)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{write_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(write_value(v) for v in value) + "]"
    return "None" if value is None else json.dumps(value)



class Gemma4ToolCallParser(CallStream):
    """One per reply; feed it text in order (`push`), then `flush` once at the end."""

    def __init__(self, tool_names: list[str], parallel: bool = True,
                 new_id: Callable[[], str] = openai_call_id):
        super().__init__()
        self.names, self.parallel, self.new_id = set(tool_names), parallel, new_id
        self._in_call = False
        self._name: str | None = None

    def _step(self, final: bool) -> bool:
        return self._call(final) if self._in_call else self._top(final)

    def _top(self, final: bool) -> bool:
        if self._until(OPEN, final) < 0:
            return False
        self._buf, self._in_call, self._name = self._buf[len(OPEN):], True, None
        return True

    def _call(self, final: bool) -> bool:
        if self._name is None:
            m = _NAME.match(self._buf[:MAX_NAME])  # a window: the same for every split
            if m is None:
                if (not final and len(self._buf) < MAX_NAME
                        and _NAME_PREFIX.fullmatch(self._buf)):
                    return False
                return self._give_back()
            if m.group(1) not in self.names:
                return self._give_back()
            self._name, self._buf = m.group(1), self._buf[m.end():]
            self._start_call()
            return True
        end = self._buf.find("}" + CLOSE)
        while end >= 0:  # the first `}<tool_call|>` that closes a well-formed object
            try:
                args, pos = parse_object(self._buf, 0)
            except GemmaSyntaxError:
                args, pos = None, -1
            if pos == end + 1:
                self._finish(args, end + 1 + len(CLOSE))
                return True
            end = self._buf.find("}" + CLOSE, end + 1)
        if not final:
            return False
        try:
            args = parse_object(self._buf + "}", 0)[0]
        except GemmaSyntaxError:
            args = {}
        self._finish(args, len(self._buf))
        return False

    def _give_back(self) -> bool:
        self._emit(OPEN)
        self._in_call = False
        return True

    def _start_call(self) -> None:
        self._ws, self._any_call = "", True
        if self.parallel or self.calls == 0:
            self._deltas.append(ToolCallDelta(index=self.calls, id=self.new_id(),
                                              name=self._name))
            self.calls += 1
        else:
            self._name = ""  # dropped

    def _finish(self, args: dict[str, Any] | None, consumed: int) -> None:
        if self._name:
            last = self._deltas[-1] if self._deltas else None
            text = json.dumps(args or {}, ensure_ascii=False)
            if last is not None and last.index == self.calls - 1:
                last.arguments += text
            else:
                self._deltas.append(ToolCallDelta(index=self.calls - 1, arguments=text))
        self._buf = self._buf[consumed:]
        self._in_call, self._name, self._fresh = False, None, True
