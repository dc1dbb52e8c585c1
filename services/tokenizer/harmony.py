"""gpt-oss's harmony replies, streamed: the `analysis` channel is reasoning, the `final` channel
content, and a `commentary` message addressed `to=functions.NAME` a tool call (its body the
arguments), as OpenAI's `openai-harmony` parser reads them.

A reply is a sequence of messages. The prompt ends with `<|start|>assistant`, so the first
message starts with its header's rest; later ones repeat `<|start|>assistant`:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

Rules:
- A header runs to `<|message|>`; its channel follows `<|channel|>`, its recipient `to=` (either
  before or after the channel); the content type (`json`, `<|constrain|>json`) is ignored. A body
  runs to `<|end|>`, `<|call|>`, `<|return|>` or `<|start|>` (or the end of the reply).
- analysis → reasoning; final, a message with no channel, and commentary addressed to no one (a
  preamble) → content; commentary (or any channel) addressed `to=functions.NAME` with NAME one of
  the request's tools → a tool call, arguments streamed as written; addressed to anything else →
  content. With `parallel` false, calls after the first are dropped.
- Text that never reaches `<|message|>` within `MAX_HEADER` characters is not a header: it is
  content (a model that skips the format is still heard); so is a header cut short by the end.
- The parser reads text: a control token's text written as ordinary tokens reads as the control
  token (the model does not write them so). Partial control tokens are held back until the next
  piece decides them. Every decision depends only on the text so far: the output concatenated is
  the same for every split of the reply.
Enabled for vocabularies with harmony's control tokens (`control_ids`), chat requests only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

from flotilla.libs.common.messages import ToolCallDelta
from flotilla.services.tokenizer.stop_strings import partial_suffix
from flotilla.services.tokenizer.tokenizer import Tokenizer

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
CONTROL = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
# A structured answer (response_format) is constrained from here on: reasoning stays free.
FINAL = f"{CHANNEL}final{MESSAGE}"
_BODY_ENDS = [END, CALL, RETURN, START]
MAX_HEADER = 256
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_FUNCTIONS = "functions."


class HarmonyDelta(NamedTuple):
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = []


def control_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of harmony's control tokens when the vocabulary has each as one special token (the
    detokenizer then keeps them as text for the parser), else empty: not a harmony model."""
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in CONTROL]
    if all(len(i) == 1 and i[0] in tokenizer.special_ids for i in ids):
        return frozenset(i[0] for i in ids)
    return frozenset()


class HarmonyParser:
    """One per reply; feed it text in order (`push`), then `flush` once at the end."""

    def __init__(self, tool_names: list[str], parallel: bool = True,
                 new_id: Callable[[], str] = lambda: ""):
        self.names = set(tool_names)
        self.parallel, self.new_id = parallel, new_id
        self.calls = 0  # calls emitted
        self._buf = ""
        self._in_header = True
        self._route = "content"  # where the current body goes: reasoning | content | call | drop
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def push(self, text: str) -> HarmonyDelta:
        self._buf += text
        self._run(final=False)
        return self._take()

    def flush(self) -> HarmonyDelta:
        self._run(final=True)
        return self._take()

    def _take(self) -> HarmonyDelta:
        out = HarmonyDelta("".join(self._reasoning), "".join(self._content), self._deltas)
        self._reasoning, self._content, self._deltas = [], [], []
        return out

    def _run(self, final: bool) -> None:
        while self._buf and (self._header(final) if self._in_header else self._body(final)):
            pass

    def _header(self, final: bool) -> bool:
        limit = MAX_HEADER + len(MESSAGE)  # searched only this far: the same for every split
        at = self._buf.find(MESSAGE, 0, limit)
        if at < 0:
            if len(self._buf) < limit and not final:
                return False
            self._in_header, self._route = False, "content"  # not a header: plain text
            lead = START if self._buf.startswith(START) else ""  # (else read as a body end)
            self._out(lead)
            self._buf = self._buf[len(lead):]
            return True
        header = self._buf[:at].removeprefix(START).strip()
        self._buf = self._buf[at + len(MESSAGE):]
        self._in_header = False
        self._route = self._route_of(header)
        return True

    def _route_of(self, header: str) -> str:
        """Where the body of a message with this header goes (starting a call if it is one)."""
        recipient = m.group(1) if (m := _RECIPIENT.search(header)) else None
        words = header.split(CHANNEL, 1)[1].split() if CHANNEL in header else []
        channel = words[0] if words else ""  # a model may write an empty channel name
        channel = channel.split("<|", 1)[0]
        if recipient is None:
            return "reasoning" if channel == "analysis" else "content"
        name = recipient.removeprefix(_FUNCTIONS)
        if not recipient.startswith(_FUNCTIONS) or name not in self.names:
            return "content"
        if not self.parallel and self.calls > 0:
            return "drop"
        self._deltas.append(ToolCallDelta(index=self.calls, id=self.new_id(), name=name))
        self.calls += 1
        return "call"

    def _body(self, final: bool) -> bool:
        found = [(i, m) for m in _BODY_ENDS if (i := self._buf.find(m)) >= 0]
        if found:
            at, marker = min(found)
            self._out(self._buf[:at])
            self._buf = self._buf[at + (0 if marker == START else len(marker)):]
            self._in_header = True
            return True
        keep = 0 if final else partial_suffix(self._buf, _BODY_ENDS)
        self._out(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _out(self, text: str) -> None:
        if not text:
            return
        if self._route == "reasoning":
            self._reasoning.append(text)
        elif self._route == "content":
            self._content.append(text)
        elif self._route == "call":
            last = self._deltas[-1] if self._deltas else None
            if last is not None and last.index == self.calls - 1:
                last.arguments += text
            else:
                self._deltas.append(ToolCallDelta(index=self.calls - 1, arguments=text))
