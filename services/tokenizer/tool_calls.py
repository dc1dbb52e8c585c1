"""Tool calls out of a streamed reply, in the Hermes/Qwen form the tool prompt asks for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rules:
- Text outside the blocks is content; a partial `<tool_call>` is held back until decided.
- A block becomes one ToolCallDelta (id, name, arguments as JSON text) when it closes, or at the
  end of the reply if the model stopped before `</tool_call>`. A block that is not a JSON object
  naming one of the request's tools is passed through as content, verbatim.
- After the first call, whitespace-only content is dropped (the newlines between blocks);
  with `parallel_tool_calls` false, only the first call is kept.
"""

from __future__ import annotations

import json
import uuid
from typing import NamedTuple

from libs.common.messages import ToolCallDelta
from services.tokenizer.stop_strings import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Parsed(NamedTuple):
    content: str = ""
    calls: list[ToolCallDelta] = []


class ToolCallParser:
    def __init__(self, tool_names: list[str], parallel: bool = True):
        self.names = set(tool_names)
        self.parallel = parallel
        self.calls = 0
        self._inside = False
        self._buf = ""

    def push(self, text: str) -> Parsed:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if not self._inside:
                idx = self._buf.find(OPEN)
                if idx < 0:
                    keep = partial_suffix(self._buf, [OPEN])
                    content.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:idx])
                self._buf, self._inside = self._buf[idx + len(OPEN):], True
            idx = self._buf.find(CLOSE)
            if idx < 0:
                break
            block, self._buf, self._inside = self._buf[:idx], self._buf[idx + len(CLOSE):], False
            self._take(block, closed=True, content=content, calls=calls)
        return self._result(content, calls)

    def flush(self) -> Parsed:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self._inside:
            self._take(self._buf, closed=False, content=content, calls=calls)
        else:
            content.append(self._buf)
        self._buf, self._inside = "", False
        return self._result(content, calls)

    def _take(self, block: str, closed: bool, content: list[str],
              calls: list[ToolCallDelta]) -> None:
        call = self._parse(block)
        if call is None:
            content.append(OPEN + block + (CLOSE if closed else ""))
            return
        if self.parallel or self.calls == 0:
            calls.append(call)
            self.calls += 1

    def _parse(self, block: str) -> ToolCallDelta | None:
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCallDelta(index=self.calls, id=f"call_{uuid.uuid4().hex[:24]}",
                             name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))

    def _result(self, content: list[str], calls: list[ToolCallDelta]) -> Parsed:
        text = "".join(content)
        if (self.calls or calls) and not text.strip():
            text = ""
        return Parsed(content=text, calls=calls)
