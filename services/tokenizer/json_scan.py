"""Incremental JSON scanning, one character at a time, for tool calls arriving as a stream.

Only structure is tracked (brackets, strings, escapes), not full validity: the scanners say where
a value or a call object ends, which key a value belongs to, and where the arguments are, so
their characters can be passed on the moment they arrive.

- `JsonValue.feed(ch)` returns True when `ch` belongs to the value, False when the value ended
  just before `ch` (only a bare literal such as `12` or `true` ends that way), and raises
  `JsonError` when `ch` cannot continue it. `done` is set once the value is complete.
- `CallObject.feed(ch)` scans `{"name": ..., "arguments": ...}` (or "parameters"): it returns an
  `Event` telling the caller that the name just completed, that `ch` is a character of the
  arguments, that the arguments or the whole object just ended. Keys other than name, arguments,
  parameters, type and id raise `JsonError`: such an object is not a tool call.
"""

from __future__ import annotations

import enum
import json

_CLOSING = {"{": "}", "[": "]"}
_LITERAL_START = set("-0123456789tfn")
_LITERAL_END = set(",}]; \t\r\n")
ARGUMENT_KEYS = ("arguments", "parameters")
CALL_KEYS = ("name", *ARGUMENT_KEYS, "type", "id")


class JsonError(ValueError):
    """The text stopped being the JSON expected here."""


def _string(raw: str) -> str:
    try:
        value = json.loads(raw, strict=False)
    except json.JSONDecodeError as exc:
        raise JsonError(f"bad string {raw!r}") from exc
    return str(value)


class JsonValue:
    def __init__(self) -> None:
        self.first = ""  # the value's first character: { [ " or a literal's
        self.done = False
        self._stack: list[str] = []
        self._in_string = False
        self._escape = False

    def feed(self, ch: str) -> bool:
        if not self.first:
            if ch in _CLOSING:
                self._stack.append(_CLOSING[ch])
            elif ch == '"':
                self._in_string = True
            elif ch not in _LITERAL_START:
                raise JsonError(f"{ch!r} cannot start a JSON value")
            self.first = ch
            return True
        if self.done:
            return False
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                self.done = not self._stack
            return True
        if not self._stack:  # a bare literal
            if ch in _LITERAL_END:
                self.done = True
                return False
            return True
        if ch == '"':
            self._in_string = True
        elif ch in _CLOSING:
            self._stack.append(_CLOSING[ch])
        elif ch in "}]":
            if ch != self._stack.pop():
                raise JsonError(f"unbalanced {ch!r}")
            self.done = not self._stack
        return True


class Event(enum.Enum):
    NONE = 0
    NAME = 1  # the "name" string just ended (CallObject.name is set)
    ARGS = 2  # ch is a character of the arguments value
    ARGS_END = 3  # ch ended the arguments value (a string or a container; literals just stop)
    END = 4  # ch closed the object


class CallObject:
    """A call object after its `{` (see module rules)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.args_first = ""  # first character of the arguments value, once it started
        self.args_raw = ""  # the arguments as written (kept only for a string value)
        self._state = "key_or_end"
        self._key = ""
        self._key_value: JsonValue | None = None
        self._value: JsonValue | None = None
        self._raw = ""

    @property
    def in_args(self) -> bool:
        return self._state == "value" and self._key in ARGUMENT_KEYS

    def feed(self, ch: str) -> Event:
        state = self._state
        if state in ("key_or_end", "key", "colon", "value_start", "after_value") and ch.isspace():
            return Event.NONE
        if state in ("key_or_end", "key"):
            if ch == "}" and state == "key_or_end":
                self._state = "closed"
                return Event.END
            if ch != '"':
                raise JsonError("expected a key")
            self._key_value, self._state = JsonValue(), "in_key"
            self._key_value.feed(ch)
            self._raw = ch
            return Event.NONE
        if state == "in_key":
            assert self._key_value is not None
            self._key_value.feed(ch)
            self._raw += ch
            if self._key_value.done:
                self._key = _string(self._raw)
                if self._key not in CALL_KEYS:
                    raise JsonError(f"key {self._key!r} is not part of a tool call")
                self._state = "colon"
            return Event.NONE
        if state == "colon":
            if ch != ":":
                raise JsonError("expected ':'")
            self._state = "value_start"
            return Event.NONE
        if state == "value_start":
            self._value, self._state, self._raw = JsonValue(), "value", ""
            if self._key == "name" and ch != '"':
                raise JsonError("the name must be a string")
            if self._key in ARGUMENT_KEYS:
                self.args_first = ch
        if state in ("value_start", "value"):
            return self._feed_value(ch)
        if state == "after_value":
            if ch == ",":
                self._state = "key"
                return Event.NONE
            if ch == "}":
                self._state = "closed"
                return Event.END
            raise JsonError("expected ',' or '}'")
        raise JsonError("the call object is already closed")

    def _feed_value(self, ch: str) -> Event:
        assert self._value is not None
        if not self._value.feed(ch):  # a literal ended before ch: ch belongs to the object
            self._state = "after_value"
            return self.feed(ch)
        self._raw += ch
        if self._key in ARGUMENT_KEYS:
            if self._value.done:
                self._state = "after_value"
                self.args_raw = self._raw
                return Event.ARGS_END
            return Event.ARGS
        if self._value.done:
            self._state = "after_value"
            if self._key == "name":
                self.name = _string(self._raw)
                return Event.NAME
        return Event.NONE
