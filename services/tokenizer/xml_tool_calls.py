"""Tool calls whose arguments are written one parameter at a time in XML-like tags, not as JSON:

- glm       `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`
            (GLM-4.5 / 4.6 / 4.7)
- qwen_xml  `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n...</function>\\n
            </tool_call>` (Qwen3-Coder, Qwen3.5, Qwen3-Next)
- minimax   `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n...
            </invoke>\\n...</minimax:tool_call>` (MiniMax-M2: several calls in one block)
- dsml      the same shape with `<｜DSML｜function_calls>`, `<｜DSML｜invoke name=...>` and
            `<｜DSML｜parameter name="K" string="true|false">` (DeepSeek-V3.2)

Their templates write a string value as it is and any other value as JSON, so a value is read
back by the tool's `parameters` schema: a parameter typed `string` (or a union with `string`)
is that text; any other is parsed as JSON, and is the text when it does not parse (DSML's
`string="true"` / `"false"` attribute, when written, decides instead of the schema). Arguments are
streamed as JSON, one `"K": V` pair at a time as each closing tag arrives, `}` at the end.

Rules otherwise as tool_calls.py: text outside calls is content; a candidate call is held back
until its function name is complete, committed when it names one of the request's tools, else
passed through as content; text that breaks a committed call between parameters ends it (what
follows is content), while an open parameter waits for its closing tag (a value may hold any
text); a call cut short keeps its complete parameters; whitespace-only text before the first call,
between calls and after the last is dropped; with `parallel` false calls after the first are
dropped; the output concatenated is the same for every split of the reply. In the block
formats (minimax, dsml) calls follow each other inside one block until its closing tag; text
there that starts no call ends the block, and is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flotilla.libs.common.messages import ToolCallDelta
from flotilla.services.tokenizer.call_stream import CallStream, openai_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_NAME = 256  # a name not complete within this many characters is not a call


@dataclass(frozen=True)
class XmlSyntax:
    """One family's call syntax as regular expressions over the text after `open`."""

    name: re.Pattern[str]  # the function name (group 1), anchored at the start
    param: re.Pattern[str]  # one complete parameter: groups `key`, `value` (and `string`)
    param_start: str  # what an incomplete parameter starts with
    closing: tuple[str, ...]  # the tags that close the call, whitespace allowed between
    open: str = OPEN  # the tag a call (or a block of calls) opens with
    name_start: str = ""  # a tagged name's opening (the name ends at the next `>`); "": bare
    block_close: str = ""  # the tag that ends a block of calls ("": one call per `open`)

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
                re.compile(r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)"
                           r"</arg_value>", re.S), "<arg_key>", (CLOSE,))
QWEN_XML = XmlSyntax(re.compile(r"\s*<function=([^\s<>]+)>"),
                     re.compile(r"\s*<parameter=(?P<key>[^>]*)>\n?(?P<value>.*?)\n?</parameter>",
                                re.S), "<parameter=", ("</function>", CLOSE),
                     name_start="<function=")
MINIMAX = XmlSyntax(re.compile(r'\s*<invoke name="([^"<>]+)">'),
                    re.compile(r'\s*<parameter name="(?P<key>[^"]*)">(?P<value>.*?)</parameter>',
                               re.S), "<parameter name=", ("</invoke>",),
                    open="<minimax:tool_call>", name_start='<invoke name="',
                    block_close="</minimax:tool_call>")
_DSML = "｜DSML｜"
DSML = XmlSyntax(re.compile(rf'\s*<{_DSML}invoke name="([^"<>]+)">'),
                 re.compile(rf'\s*<{_DSML}parameter name="(?P<key>[^"]*)"'
                            rf'(?: string="(?P<string>true|false)")?>(?P<value>.*?)'
                            rf"</{_DSML}parameter>", re.S), f"<{_DSML}parameter name=",
                 (f"</{_DSML}invoke>",), open=f"<{_DSML}function_calls>",
                 name_start=f'<{_DSML}invoke name="', block_close=f"</{_DSML}function_calls>")
SYNTAXES = {"glm": GLM, "qwen_xml": QWEN_XML, "minimax": MINIMAX, "dsml": DSML}


def _string_typed(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return True
    return any(_string_typed(s) for s in schema.get("anyOf") or schema.get("oneOf") or [])


def value_json(raw: str, schema: Any, string: bool | None = None) -> str:
    """A parameter's written value as JSON text (see module rules); `string`: what the call
    itself says the value is, when it says."""
    if not (_string_typed(schema) if string is None else string):
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
        self._block = False  # inside a block of calls, after its first (block formats)
        self._name: str | None = None  # the current call's committed name
        self._dropping = False
        self._params = 0  # parameters of the current call already emitted

    def _step(self, final: bool) -> bool:
        return self._call(final) if self._in_call else self._top(final)

    def _top(self, final: bool) -> bool:
        if self._until(self.syntax.open, final) < 0:
            return False
        self._in_call, self._name, self._params = True, None, 0
        return True

    def _call(self, final: bool) -> bool:
        opened = len(self.syntax.open)
        body = self._buf[opened:]
        if self._name is None:
            return self._start(body, final)
        pos = 0
        pairs = []
        while m := self.syntax.param.match(body, pos):
            marked = m.groupdict().get("string")
            pairs.append((m.group("key").strip(), m.group("value"),
                          None if marked is None else marked == "true"))
            pos = m.end()
        for key, raw, string in pairs[self._params:]:
            schema = self.schemas.get(self._name, {}).get(key)
            sep = "" if self._params == 0 else ", "
            self._args(f"{sep}{json.dumps(key, ensure_ascii=False)}: "
                       f"{value_json(raw, schema, string)}")
            self._params += 1
        rest = body[pos:]
        if (length := self.syntax.closes(rest)) is not None:
            return self._finish(opened + pos + length)
        stripped = rest.lstrip()
        if final:
            return self._finish(len(self._buf))
        if (stripped.startswith(self.syntax.param_start)
                or self.syntax.param_start.startswith(stripped) or self.syntax.may_close(rest)):
            return False
        return self._finish(opened + pos + len(rest) - len(stripped))

    def _start(self, body: str, final: bool) -> bool:
        """Before the name is complete: wait, commit the call, or give the text back. The name
        is looked for in the first MAX_NAME characters only: the same for every split."""
        if self._block and body.lstrip().startswith(self.syntax.block_close):
            return self._end_block(body.lstrip()[len(self.syntax.block_close):])
        m = self.syntax.name.match(body[:MAX_NAME])
        if m is None:
            if not final and len(body) < MAX_NAME and self._could_start(body):
                return False
            return self._end_block(body.lstrip()) if self._block else self._give_back()
        name = m.group(1)
        if name not in self.schemas:
            return self._end_block(body.lstrip()) if self._block else self._give_back()
        self._name, self._ws, self._any_call, self._params = name, "", True, 0
        self._dropping = not self.parallel and self.calls > 0
        if not self._dropping:
            self._deltas.append(ToolCallDelta(index=self.calls, id=self.new_id(), name=name))
            self.calls += 1
        self._args("{")
        self._buf = self.syntax.open + body[m.end():]
        return True

    def _could_start(self, body: str) -> bool:
        """`body` (the text after the opening tag) may still become a call's opening (or, in a
        block, the block's closing tag)."""
        stripped = body.lstrip()
        if self._block and self.syntax.block_close.startswith(stripped):
            return True
        if self.syntax.name_start:
            return self.syntax.name_start.startswith(stripped) or (
                stripped.startswith(self.syntax.name_start) and ">" not in stripped)
        head = re.match(r"\s*[^\s<>]*", body)
        rest = body[head.end():] if head else body
        return not rest or (bool(head and head.group().strip()) and (
            "<arg_key>".startswith(rest) or CLOSE.startswith(rest)))

    def _give_back(self) -> bool:
        """The candidate is not a call: its opening tag is content, scanning resumes after
        it."""
        self._emit(self.syntax.open)
        self._buf = self._buf[len(self.syntax.open):]
        self._in_call = False
        return True

    def _end_block(self, rest: str) -> bool:
        """A block of calls ends (its closing tag consumed, or text that starts no call):
        `rest` is scanned as content."""
        self._buf, self._in_call, self._block = rest, False, False
        return True

    def _finish(self, consumed: int) -> bool:
        self._args("}")
        self._buf = self._buf[consumed:]
        self._in_call, self._name, self._dropping = False, None, False
        if self.syntax.block_close:  # the next call of the block, or its end
            self._buf, self._in_call, self._block = self.syntax.open + self._buf, True, True
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
