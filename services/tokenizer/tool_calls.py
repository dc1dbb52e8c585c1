"""Tool calls out of a streamed reply, in every format of tool_formats.py, as OpenAI-shaped deltas:
a call's first delta carries its index, id and name, later ones fragments of its arguments.

Rules:
- Text outside calls is content. A candidate call starts at a marker (`<tool_call>`,
  `[TOOL_CALLS]`, `<function=`, `<|python_tag|>`), or with `{` / `[` at the start of the reply or
  right after a call. It is held back until decided: committed once its function name is
  complete and names one of the request's tools, else passed through as content, verbatim.
- A committed call's arguments are passed on character by character, exactly as the model writes
  them (an arguments value written as a JSON string is decoded, at its end). A call cut short
  (max_tokens) keeps what arrived; text that breaks a committed call ends it and is content.
- Whitespace next to calls (before a first call that opens the reply, between calls, after the
  last) is dropped; all other whitespace is content.
- With `parallel` false, calls after the first are dropped.
- Every decision depends only on the text so far, never on how it was split into pieces: the
  deltas concatenated are the same for every split of the same reply.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable

from flotilla.libs.common.messages import ToolCallDelta
from flotilla.services.tokenizer.call_stream import CallStream, Parsed, openai_call_id
from flotilla.services.tokenizer.json_scan import CallObject, Event, JsonError, JsonValue
from flotilla.services.tokenizer.stop_strings import partial_suffix

HERMES, MISTRAL, FUNCTION = "<tool_call>", "[TOOL_CALLS]", "<function="
PYTHON_TAG = "<|python_tag|>"
MARKERS = [HERMES, MISTRAL, FUNCTION, PYTHON_TAG]
HERMES_CLOSE, FUNCTION_CLOSE, ARGS, CALL_ID = "</tool_call>", "</function>", "[ARGS]", "[CALL_ID]"
_OPENS = {HERMES: "hermes_open", MISTRAL: "mistral_open", FUNCTION: "fn_name",
          PYTHON_TAG: "json_open"}
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")
_AFTER_OBJECT = {"hermes": "hermes_close", "json": "json_after", "list": "list_after",
                 "mistral": "top"}




def _decoded(raw: str) -> str:
    """An arguments value written as a JSON string: its text (raw when it does not decode)."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    return value if isinstance(value, str) else raw


class ToolCallParser(CallStream):
    """One per reply; feed it text in order (`push`), then `flush` once at the end."""

    def __init__(self, tool_names: list[str], parallel: bool = True,
                 new_id: Callable[[], str] = openai_call_id):
        super().__init__()
        self.names = set(tool_names)
        self.parallel = parallel
        self.new_id = new_id
        self._pos = 0
        self._state = "top"
        self._after = ""  # what follows the current call object
        self._cand = ""  # text of the undecided candidate
        self._committed = self._dropping = False
        self._obj: CallObject | None = None
        self._val: JsonValue | None = None
        self._pending_args = ""  # arguments seen before the name committed the call
        self._string_args = ""  # a string-valued arguments value, decoded at its end
        self._name = self._call_id = ""

    # ------------------------------------------------------------------ API

    def push(self, text: str) -> Parsed:
        self._buf, self._pos = self._buf[self._pos:] + text, 0
        self._run(final=False)
        return self._take()

    # ------------------------------------------------------------------ output

    def _fail(self) -> bool:
        """The candidate is not a call: its text is content; scanning resumes after it."""
        cand = self._cand
        self._reset("top")
        self._emit(cand)
        return True

    def _reset(self, state: str) -> None:
        self._state, self._cand, self._after = state, "", ""
        self._obj = self._val = None
        self._name = self._call_id = self._pending_args = self._string_args = ""

    def _commit(self, name: str, call_id: str = "") -> None:
        self._ws, self._cand = "", ""
        self._committed = self._any_call = True
        self._dropping = not self.parallel and self.calls > 0
        if not self._dropping:
            self._deltas.append(ToolCallDelta(index=self.calls, id=call_id or self.new_id(),
                                              name=name))
            self.calls += 1
        pending, self._pending_args = self._pending_args, ""
        self._args(pending)

    def _args(self, text: str) -> None:
        if not self._committed:
            self._pending_args += text
            return
        if self._dropping or not text:
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == self.calls - 1:
            last.arguments += text
        else:
            self._deltas.append(ToolCallDelta(index=self.calls - 1, arguments=text))

    def _end_call(self, state: str) -> bool:
        self._committed = self._dropping = False
        self._fresh = True
        self._reset(state)
        return True

    # ------------------------------------------------------------------ scanning

    def _run(self, final: bool) -> None:
        while getattr(self, "_" + self._state)(final):
            pass

    def _rest(self) -> str:
        return self._buf[self._pos:]

    def _consume(self, n: int) -> str:
        text = self._buf[self._pos:self._pos + n]
        self._pos += n
        if not self._committed:
            self._cand += text
        return text

    def _skip_space(self) -> str:
        rest = self._rest()
        self._consume(len(rest) - len(rest.lstrip()))
        return self._rest()

    def _open_object(self, after: str) -> bool:
        self._consume(1)
        self._obj, self._after, self._state = CallObject(), after, "object"
        return True

    def _top(self, final: bool) -> bool:
        rest = self._rest()
        if self._fresh and rest[:1].isspace():
            n = len(rest) - len(rest.lstrip())
            self._emit(rest[:n])
            self._pos += n
            rest = rest[n:]
        if not rest:
            return False
        found = [(i, m) for m in MARKERS if (i := rest.find(m)) >= 0]
        idx, marker = min(found) if found else (-1, "")
        if self._fresh and rest[0] in "{[" and idx != 0:
            if not final and len(rest) < len(MISTRAL) and MISTRAL.startswith(rest):
                return False
            return self._open_object("json") if rest[0] == "{" else self._to("list_open", 1)
        if idx >= 0:
            self._emit(rest[:idx])
            self._pos += idx
            return self._to(_OPENS[marker], len(marker))
        keep = 0 if final else partial_suffix(rest, MARKERS)
        self._emit(rest[:len(rest) - keep])
        self._pos += len(rest) - keep
        return False

    def _to(self, state: str, consume: int) -> bool:
        self._consume(consume)
        self._state = state
        return True

    def _opening(self, final: bool, choices: dict[str, str]) -> bool:
        """After a marker: whitespace, then `{` (a call object) or `[` (a list of them)."""
        rest = self._skip_space()
        if not rest:
            return self._fail() if final else False
        if rest[0] == "{" and "{" in choices:
            return self._open_object(choices["{"])
        if rest[0] == "[" and "[" in choices:
            return self._to("list_open", 1)
        if "name" in choices and rest[0] in _NAME_CHARS:
            self._state = "mistral_name"
            return True
        return self._fail()

    def _hermes_open(self, final: bool) -> bool:
        return self._opening(final, {"{": "hermes"})

    def _json_open(self, final: bool) -> bool:
        return self._opening(final, {"{": "json", "[": "list"})

    def _mistral_open(self, final: bool) -> bool:
        return self._opening(final, {"{": "mistral", "[": "list", "name": ""})

    def _list_open(self, final: bool) -> bool:
        return self._opening(final, {"{": "list"})

    def _object(self, final: bool) -> bool:
        obj = self._obj
        assert obj is not None
        while self._pos < len(self._buf):
            ch = self._buf[self._pos]
            try:
                event = obj.feed(ch)
            except JsonError:
                return self._end_call("top") if self._committed else self._fail()
            self._consume(1)
            if event is Event.ARGS and obj.args_first != '"':
                self._args(ch)
            elif event is Event.ARGS_END:
                self._args(_decoded(obj.args_raw) if obj.args_first == '"' else ch)
            elif event is Event.NAME:
                if obj.name not in self.names:
                    return self._fail()
                self._commit(obj.name)
            elif event is Event.END:
                if not self._committed:
                    return self._fail()
                return self._end_call(_AFTER_OBJECT[self._after])
        if final:
            return self._end_call("top") if self._committed else self._fail()
        return False

    def _closing(self, final: bool, tag: str) -> bool:
        """After a call: whitespace and the closing tag are dropped; anything else is content."""
        rest = self._rest()
        stripped = rest.lstrip()
        if stripped.startswith(tag):
            self._pos += len(rest) - len(stripped) + len(tag)
        elif tag.startswith(stripped):  # empty, or a part of the tag
            if not final:
                return False
            self._pos = len(self._buf)
        self._state = "top"
        return True

    def _hermes_close(self, final: bool) -> bool:
        return self._closing(final, HERMES_CLOSE)

    def _fn_close(self, final: bool) -> bool:
        return self._closing(final, FUNCTION_CLOSE)

    def _json_after(self, final: bool) -> bool:
        """After a JSON call: separators (`;`, `,`) and whitespace, then maybe another call."""
        rest = self._rest()
        i = 0
        while i < len(rest) and (rest[i].isspace() or rest[i] in ";,"):
            i += 1
        if i == len(rest) and not final:
            return False
        if i < len(rest) and rest[i] == "{":
            self._pos += i
            return self._open_object("json")
        if i == len(rest):
            self._pos += i
        self._state = "top"
        return True

    def _list_after(self, final: bool) -> bool:
        rest = self._rest()
        stripped = rest.lstrip()
        if not stripped and not final:
            return False
        self._pos += len(rest) - len(stripped)
        if stripped[:1] in (",", "]"):
            self._pos += 1
            self._state = "list_next" if stripped[0] == "," else "top"
            return True
        self._state = "top"
        return True

    def _list_next(self, final: bool) -> bool:
        rest = self._skip_space()
        if rest[:1] == "{":
            return self._open_object("list")
        if not rest and not final:
            return False
        self._state = "top"
        return True

    def _names(self, final: bool, field: str, markers: tuple[str, ...]) -> str | None:
        """Scan name characters into `field`; the marker that follows them, None to wait, ""
        when something else follows (the candidate fails)."""
        rest = self._rest()
        i = 0
        while i < len(rest) and rest[i] in _NAME_CHARS:
            i += 1
        setattr(self, field, getattr(self, field) + self._consume(i))
        rest = rest[i:]
        for marker in markers:
            if rest.startswith(marker):
                self._consume(len(marker))
                return marker
        if not final and any(m.startswith(rest) for m in markers):
            return None
        return ""

    def _start_args(self, after: str) -> bool:
        if self._name not in self.names:
            return self._fail()
        self._commit(self._name, self._call_id)
        self._val, self._after, self._state = JsonValue(), after, "args_value"
        return True

    def _mistral_name(self, final: bool) -> bool:
        marker = self._names(final, "_name", (ARGS, CALL_ID))
        if marker is None:
            return False
        if marker == CALL_ID:
            self._state = "mistral_id"
            return True
        return self._start_args("mistral") if marker else self._fail()

    def _mistral_id(self, final: bool) -> bool:
        marker = self._names(final, "_call_id", (ARGS,))
        if marker is None:
            return False
        return self._start_args("mistral") if marker else self._fail()

    def _fn_name(self, final: bool) -> bool:
        marker = self._names(final, "_name", (">",))
        if marker is None:
            return False
        return self._start_args("function") if marker else self._fail()

    def _args_value(self, final: bool) -> bool:
        """The arguments after `[ARGS]` or `<function=name>`: one JSON value."""
        val = self._val
        assert val is not None
        ended = False
        while self._pos < len(self._buf) and not val.done:
            ch = self._buf[self._pos]
            if not val.first and ch.isspace():
                self._pos += 1
                continue
            try:
                if not val.feed(ch):
                    ended = True
                    break
            except JsonError:
                return self._end_call("top")
            self._pos += 1
            if val.first == '"':
                self._string_args += ch
            else:
                self._args(ch)
        if not (val.done or ended or final):
            return False
        if self._string_args:
            self._args(_decoded(self._string_args))
        return self._end_call("fn_close" if self._after == "function" else "top")
