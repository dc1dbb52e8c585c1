"""Tool calls whose arguments are written one parameter at a time in XML-like tags, not as JSON:

- glm       `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`
            (GLM-4.5 / 4.6 / 4.7)
- qwen_xml  `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n...</function>\\n
            </tool_call>` (Qwen3-Coder, Qwen3.5, Qwen3-Next)

Their templates write a string value as it is and any other value as JSON, so a value is read
back by the tool's `parameters` schema: a parameter typed `string` (or a union with `string`)
is that text; any other is parsed as JSON, and is the text when it does not parse. Arguments are
streamed as JSON, one `"K": V` pair at a time as each closing tag arrives, `}` at the end.

Rules otherwise as tool_calls.py: text outside calls is content; a candidate call is held back
until its function name is complete, committed when it names one of the request's tools, else
passed through as content; text that breaks a committed call between parameters ends it (what
follows is content), while an open parameter waits for its closing tag (a value may hold any
text); a call cut short keeps its complete parameters; whitespace-only text before the first call,
between calls and after the last is dropped; with `parallel` false calls after the first are
dropped; the output concatenated is the same for every split of the reply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from libs.common.messages import ToolCallDelta
from services.tokenizer.call_stream import CallStream, openai_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_NAME = 256  # a name not complete within this many characters is not a call


@dataclass(frozen=True)
class XmlSyntax:
    """One family's call syntax as regular expressions over the text after `<tool_call>`."""

    name: re.Pattern[str]  # the function name (group 1), anchored at the start
    param: re.Pattern[str]  # one complete parameter: key (group 1), value (group 2)
    param_start: str  # what an incomplete parameter starts with
    closing: tuple[str, ...]  # the tags that close the call, whitespace allowed between

    def closes(self, text: str) -> int | None:
        """Length of the closing tags `text` starts with (after whitespace), if it does."""
        pos = 0
        for tag in self.closing:
            pos += len(text[pos:]) - len(text[pos:].lstrip())
            if not text.startswith(tag, pos):
                return None
            pos += len(tag)
        return pos

    def may_close(self, text: str) -> bool:
        """`text` is the start of the closing tags (or whitespace)."""
        rest = text
        for tag in self.closing:
            rest = rest.lstrip()
            if not rest.startswith(tag):
                return tag.startswith(rest)
            rest = rest[len(tag):]
        return False


GLM = XmlSyntax(re.compile(r"\s*([^\s<>]+?)(?=\s|<arg_key>|</tool_call>)"),
                re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S),
                "<arg_key>", (CLOSE,))
QWEN_XML = XmlSyntax(re.compile(r"\s*<function=([^\s<>]+)>"),
                     re.compile(r"\s*<parameter=([^>]*)>\n?(.*?)\n?</parameter>", re.S),
                     "<parameter=", ("</function>", CLOSE))
SYNTAXES = {"glm": GLM, "qwen_xml": QWEN_XML}


def _string_typed(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return True
    return any(_string_typed(s) for s in schema.get("anyOf") or schema.get("oneOf") or [])


def value_json(raw: str, schema: Any) -> str:
    """A parameter's written value as JSON text (see module rules)."""
    if not _string_typed(schema):
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False)
        except json.JSONDecodeError:
            pass
    return json.dumps(raw, ensure_ascii=False)



class XmlToolCallParser(CallStream):
    """One per reply; `tools` are the request's tool definitions (names and schemas)."""

    def __init__(self, syntax: XmlSyntax, tools: list[dict[str, Any]], parallel: bool = True,
                 new_id: Callable[[], str] = openai_call_id):
        super().__init__()
        self.syntax = syntax
        self.schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}).get(
            "properties") or {} for t in tools}
        self.parallel, self.new_id = parallel, new_id
        self._in_call = False
        self._name: str | None = None  # the current call's committed name
        self._dropping = False
        self._params = 0  # parameters of the current call already emitted

    def _step(self, final: bool) -> bool:
        return self._call(final) if self._in_call else self._top(final)

    def _top(self, final: bool) -> bool:
        if self._until(OPEN, final) < 0:
            return False
        self._in_call, self._name, self._params = True, None, 0
        return True

    def _call(self, final: bool) -> bool:
        body = self._buf[len(OPEN):]
        if self._name is None:
            return self._start(body, final)
        pos = 0
        pairs = []
        while m := self.syntax.param.match(body, pos):
            pairs.append((m.group(1).strip(), m.group(2)))
            pos = m.end()
        for key, raw in pairs[self._params:]:
            schema = self.schemas.get(self._name, {}).get(key)
            sep = "" if self._params == 0 else ", "
            self._args(f"{sep}{json.dumps(key, ensure_ascii=False)}: {value_json(raw, schema)}")
            self._params += 1
        rest = body[pos:]
        if (length := self.syntax.closes(rest)) is not None:
            return self._finish(len(OPEN) + pos + length)
        stripped = rest.lstrip()
        if final:
            return self._finish(len(self._buf))
        if (stripped.startswith(self.syntax.param_start)
                or self.syntax.param_start.startswith(stripped) or self.syntax.may_close(rest)):
            return False
        return self._finish(len(OPEN) + pos + len(rest) - len(stripped))

    def _start(self, body: str, final: bool) -> bool:
        """Before the name is complete: wait, commit the call, or give the text back. The name
        is looked for in the first MAX_NAME characters only: the same for every split."""
        m = self.syntax.name.match(body[:MAX_NAME])
        if m is None:
            if not final and len(body) < MAX_NAME and self._could_start(body):
                return False
            return self._give_back()
        name = m.group(1)
        if name not in self.schemas:
            return self._give_back()
        self._name, self._ws, self._any_call = name, "", True
        self._dropping = not self.parallel and self.calls > 0
        if not self._dropping:
            self._deltas.append(ToolCallDelta(index=self.calls, id=self.new_id(), name=name))
            self.calls += 1
        self._args("{")
        self._buf = OPEN + body[m.end():]
        return True

    def _could_start(self, body: str) -> bool:
        """`body` (the text after `<tool_call>`) may still become a call's opening."""
        if self.syntax is QWEN_XML:
            stripped = body.lstrip()
            return "<function=".startswith(stripped) or (
                stripped.startswith("<function=") and ">" not in stripped)
        head = re.match(r"\s*[^\s<>]*", body)
        rest = body[head.end():] if head else body
        return not rest or (bool(head and head.group().strip()) and (
            "<arg_key>".startswith(rest) or CLOSE.startswith(rest)))

    def _give_back(self) -> bool:
        """The candidate is not a call: `<tool_call>` is content, scanning resumes after it."""
        self._emit(OPEN)
        self._buf = self._buf[len(OPEN):]
        self._in_call = False
        return True

    def _finish(self, consumed: int) -> bool:
        self._args("}")
        self._buf = self._buf[consumed:]
        self._in_call, self._name, self._dropping = False, None, False
        self._fresh = True
        return True

    def _args(self, text: str) -> None:
        if self._dropping:
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == self.calls - 1:
            last.arguments += text
        else:
            self._deltas.append(ToolCallDelta(index=self.calls - 1, arguments=text))
