"""Llama 4's pythonic tool calls: the reply opens with a Python list of calls with keyword
arguments, `[get_weather(city="Paris", days=3), search(q='x')]` (Meta's format; Llama 3.2 and
Llama 4 prompts ask for it).

Rules:
- A candidate is a `[` that opens the reply (after whitespace) and goes on as `[NAME(`; it is
  held back until its brackets close (strings and nesting followed as Python writes them), then
  read with Python's own parser: a list of calls of the request's tools, each with keyword
  arguments that are literals, becomes those calls (arguments as JSON, sent whole); anything
  else, or a candidate longer than MAX_CANDIDATE characters or cut short by the end, is content.
- Whitespace after the list is dropped; the text after it is content.
- With `parallel` false, calls after the first are dropped.
- Every decision depends only on the text so far: the output is the same for every split.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

from flotilla.libs.common.messages import ToolCallDelta
from flotilla.services.tokenizer.call_stream import Parsed, openai_call_id

MAX_CANDIDATE = 65536
_OPENING = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_OPENING_PREFIX = re.compile(r"\[\s*([A-Za-z_]\w*\s*)?")



def read_calls(text: str, names: set[str]) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls a complete list expression makes, or None when it is not one of calls."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in names and not node.args):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            json.dumps(args)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if len(args) != len(node.keywords):
            return None  # **kwargs
        calls.append((node.func.id, args))
    return calls


class PythonicToolCallParser:
    """One per reply; feed it text in order (`push`), then `flush` once at the end."""

    def __init__(self, tool_names: list[str], parallel: bool = True,
                 new_id: Callable[[], str] = openai_call_id):
        self.names, self.parallel, self.new_id = set(tool_names), parallel, new_id
        self.calls = 0
        self._state = "start"  # start | candidate | after | content
        self._held = ""  # leading whitespace, then the candidate
        self._stack: list[str] = []  # open brackets and the quote being read
        self._escape = False
        self._opened = False  # the candidate reads `[NAME(` so far
        self._found: list[tuple[str, dict[str, Any]]] = []

    def push(self, text: str) -> Parsed:
        return self._feed(text, final=False)

    def flush(self) -> Parsed:
        return self._feed("", final=True)

    def _feed(self, text: str, final: bool) -> Parsed:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for i, ch in enumerate(text):
            if self._state == "content":
                content.append(text[i:])
                break
            if self._state == "after":
                if ch.isspace():
                    continue
                self._state = "content"
                content.append(text[i:])
                break
            if self._state == "start" and ch.isspace():
                self._held += ch
                continue
            if self._state == "start" and ch != "[":
                content.append(self._held + text[i:])
                self._state, self._held = "content", ""
                break
            self._state = "candidate"
            self._held += ch
            done = self._scan(ch)
            if done is not None:
                content.append(done)
                if not done:
                    deltas += self._emit()
        if final and self._state in ("start", "candidate"):
            content.append(self._held)
            self._held, self._state = "", "content"
        return Parsed("".join(content), deltas)

    def _scan(self, ch: str) -> str | None:
        """Follow one character of the candidate: None while undecided; "" when it closed as
        calls (they are in `self._held`); the held text when it is content."""
        body = self._held.lstrip()
        if not self._opened:
            if _OPENING.match(body):
                self._opened = True
            elif not _OPENING_PREFIX.fullmatch(body):
                return self._give_up()
        top = self._stack[-1] if self._stack else ""
        if top in ("'", '"'):
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == top:
                self._stack.pop()
        elif ch in "'\"":
            self._stack.append(ch)
        elif ch in "([{":
            self._stack.append(ch)
        elif ch in ")]}":
            if not self._stack or {")": "(", "]": "[", "}": "{"}[ch] != self._stack[-1]:
                return self._give_up()
            self._stack.pop()
            if not self._stack:
                calls = read_calls(body, self.names)
                if calls is None:
                    return self._give_up()
                self._found = calls
                self._state = "after"
                return ""
        if len(body) > MAX_CANDIDATE:
            return self._give_up()
        return None

    def _give_up(self) -> str:
        held, self._held, self._stack, self._state = self._held, "", [], "content"
        return held

    def _emit(self) -> list[ToolCallDelta]:
        out = []
        for name, args in self._found:
            if not self.parallel and self.calls > 0:
                break
            out.append(ToolCallDelta(index=self.calls, id=self.new_id(), name=name,
                                     arguments=json.dumps(args, ensure_ascii=False)))
            self.calls += 1
        self._held, self._found = "", []
        return out
