"""One request's way back: engine token deltas in, OpenAI-shaped text deltas out.

The text passes four stages, each holding back what it cannot decide yet:
detokenize (detokenizer.py: never half a character; special tokens only with
`skip_special_tokens` false) → stop strings
(stop_strings.py) → reasoning split (reasoning.py: `<think>` text to `reasoning`) → tool calls
(tool_calls.py: calls in any known format to `tool_calls`, chat requests with tools only,
unless tool_choice is "none"). gpt-oss replies (harmony vocabularies, chat requests) take one
stage instead of the last two: harmony.py splits their channels into reasoning, content and tool
calls. Control tokens that these stages read (`<think>`, `[TOOL_CALLS]`,
...) are detokenized as text for them.

Rules:
- once a stop string matched, `stopped` is set; the caller cancels the engine request and sends
  `stop_final()` (finish_reason "stop"); the stop string is in the text only with
  `include_stop_str_in_output`;
- the token that stopped the engine (one of the request's stop ids: end of turn, eos,
  `stop_token_ids`) is not text, unless `include_stop_str_in_output` (and, for a special token,
  `skip_special_tokens` false), as in vLLM;
- prompt logprobs (`TokenDelta.prompt_logprobs`, first delta) are passed on as text, one entry
  per prompt token, special tokens included (they are part of the prompt);
- structured requests have their finished text checked (output_check.py): a violation replaces
  the final frame with an error (`final_error`);
- logprobs (when requested) map ids to token text and bytes, top alternatives included; special
  tokens (end of turn) are not reported, as they are not part of the text;
- the engine's finish reason passes through ("stop", "length", "abort"), except that a reply that
  made tool calls and stopped on its own finishes with "tool_calls"; usage counts every token the
  engine generated up to the end (or up to the stop-string match).
"""

from __future__ import annotations

from typing import Literal

from flotilla.libs.common.messages import (
    ErrorInfo,
    TextDelta,
    TextFinal,
    TextLogprob,
    TextRequest,
    TokenDelta,
    TokenFinal,
    TokenLogprob,
    Usage,
)
from flotilla.services.tokenizer.detokenizer import IncrementalDetokenizer
from flotilla.services.tokenizer.gemma4_tool_calls import Gemma4ToolCallParser
from flotilla.services.tokenizer.harmony import HarmonyParser, control_ids
from flotilla.services.tokenizer.output_check import OutputCheck
from flotilla.services.tokenizer.pythonic_tool_calls import PythonicToolCallParser
from flotilla.services.tokenizer.reasoning import ReasoningParser
from flotilla.services.tokenizer.stop_strings import StopStringMatcher
from flotilla.services.tokenizer.tokenizer import Tokenizer
from flotilla.services.tokenizer.tool_calls import ToolCallParser
from flotilla.services.tokenizer.tool_formats import ALL_MARKERS, HERMES, ToolFormat
from flotilla.services.tokenizer.tool_prompt import tool_names
from flotilla.services.tokenizer.xml_tool_calls import SYNTAXES, XmlToolCallParser

AnyToolParser = (ToolCallParser | XmlToolCallParser | Gemma4ToolCallParser
                 | PythonicToolCallParser)
FinishReason = Literal["stop", "length", "tool_calls", "abort"]


def text_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> list[TextLogprob]:
    return [
        TextLogprob(
            token=tokenizer.token_text(lp.token_id),
            logprob=lp.logprob,
            bytes=list(tokenizer.bytes_of(lp.token_id, skip_special_tokens=False)),
            top=[(tokenizer.token_text(tid), value) for tid, value in lp.top],
        )
        for lp in logprobs if lp.token_id not in tokenizer.special_ids
    ]


def prompt_text_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob | None]
                         ) -> list[TextLogprob | None]:
    """Every prompt token's logprob as text (special tokens too; the first is None)."""
    return [None if lp is None else TextLogprob(
        token=tokenizer.token_text(lp.token_id), logprob=lp.logprob,
        bytes=list(tokenizer.bytes_of(lp.token_id, skip_special_tokens=False)),
        top=[(tokenizer.token_text(tid), value) for tid, value in lp.top],
        token_id=lp.token_id, top_ids=[tid for tid, _ in lp.top]) for lp in logprobs]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], logprobs: bool = False,
                 prompt_tokens: int = 0, reasoning: ReasoningParser | None = None,
                 tools: AnyToolParser | None = None,
                 skip_special_tokens: bool = True,
                 include_stop: bool = False, stop_ids: frozenset[int] = frozenset(),
                 check: OutputCheck | None = None, first_prompt_id: int | None = None,
                 harmony: HarmonyParser | None = None):
        self.tokenizer = tokenizer
        self.first_prompt_id = first_prompt_id
        keep = ReasoningParser.tag_ids(tokenizer) if reasoning is not None else frozenset()
        if tools is not None:
            keep |= {i for i in tokenizer.special_ids if tokenizer.text_of(i) in ALL_MARKERS}
        if harmony is not None:
            keep |= control_ids(tokenizer)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens,
                                            keep_ids=frozenset(keep))
        self.stops = StopStringMatcher(stop, include_stop)
        self.include_stop, self.stop_ids = include_stop, stop_ids
        self.reasoning, self.tools, self.harmony = reasoning, tools, harmony
        self.want_logprobs = logprobs
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.check = check
        self._content: list[str] = []  # the reply's text, for `check`

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, req: TextRequest, prompt: str,
                    prompt_tokens: int, tool_format: ToolFormat = HERMES,
                    stop_ids: frozenset[int] = frozenset(),
                    first_prompt_id: int | None = None) -> OutputProcessor:
        """`stop_ids`: the ids the engine stops at (`SamplingOptions.stop_token_ids`);
        `first_prompt_id`: the prompt's first token (named first in echoed prompt logprobs)."""
        reasoning = harmony = None
        tools: AnyToolParser | None = None
        names = tool_names(req.tools) if req.tools and req.tool_choice != "none" else None
        if req.kind == "chat" and control_ids(tokenizer):
            harmony = HarmonyParser(names or [], parallel=req.parallel_tool_calls,
                                    new_id=tool_format.new_call_id)
        elif req.kind == "chat":
            reasoning = ReasoningParser.for_prompt(tokenizer, prompt)
            if names is not None and tool_format.name == "pythonic":
                tools = PythonicToolCallParser(names, parallel=req.parallel_tool_calls,
                                               new_id=tool_format.new_call_id)
            elif names is not None and tool_format.name == "gemma4":
                tools = Gemma4ToolCallParser(names, parallel=req.parallel_tool_calls,
                                             new_id=tool_format.new_call_id)
            elif names is not None and tool_format.xml:
                tools = XmlToolCallParser(SYNTAXES[tool_format.name], req.tools or [],
                                          parallel=req.parallel_tool_calls,
                                          new_id=tool_format.new_call_id)
            elif names is not None:
                tools = ToolCallParser(names, parallel=req.parallel_tool_calls,
                                       new_id=tool_format.new_call_id)
        return cls(tokenizer, req.stop, logprobs=req.sampling.logprobs is not None,
                   prompt_tokens=prompt_tokens, reasoning=reasoning, tools=tools,
                   skip_special_tokens=req.skip_special_tokens,
                   include_stop=req.include_stop_str_in_output, stop_ids=stop_ids,
                   check=OutputCheck.for_request(req), first_prompt_id=first_prompt_id,
                   harmony=harmony)

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def _split(self, text: str, final: bool = False) -> TextDelta:
        """Route text through the reasoning and tool-call stages (`final`: flush them)."""
        if self.harmony is not None:
            got = self.harmony.push(text)
            end = self.harmony.flush() if final else None
            out = TextDelta(text=got.content + (end.content if end else ""),
                            reasoning=got.reasoning + (end.reasoning if end else ""),
                            tool_calls=got.calls + (end.calls if end else []))
            if self.check is not None:
                self._content.append(out.text)
            return out
        reasoning = ""
        if self.reasoning is not None:
            split = self.reasoning.push(text)
            tail = self.reasoning.flush() if final else None
            reasoning = split.reasoning + (tail.reasoning if tail else "")
            text = split.content + (tail.content if tail else "")
        if self.tools is None:
            out = TextDelta(text=text, reasoning=reasoning)
        else:
            parsed = self.tools.push(text)
            rest = self.tools.flush() if final else None
            out = TextDelta(text=parsed.content + (rest.content if rest else ""),
                            reasoning=reasoning,
                            tool_calls=parsed.calls + (rest.calls if rest else []))
        if self.check is not None:
            self._content.append(out.text)
        return out

    @staticmethod
    def _empty(delta: TextDelta) -> bool:
        return not (delta.text or delta.reasoning or delta.tool_calls or delta.logprobs
                    or delta.prompt_logprobs)

    def _text_ids(self, ids: list[int]) -> list[int]:
        """The ids that become text: the engine's stop token only with include_stop."""
        if ids and ids[-1] in self.stop_ids and not self.include_stop:
            return ids[:-1]
        return ids

    def on_tokens(self, delta: TokenDelta) -> TextDelta | None:
        """The text delta for newly generated tokens (None when there is nothing to send)."""
        if self.stopped:
            return None
        self.completion_tokens += len(delta.token_ids)
        text = self.detok.push(self._text_ids(delta.token_ids))
        out = self._split(self.stops.push(text).text, final=self.stopped)
        if self.want_logprobs and delta.logprobs:
            out.logprobs = text_logprobs(self.tokenizer, delta.logprobs)
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = prompt_text_logprobs(self.tokenizer, delta.prompt_logprobs)
            if self.first_prompt_id is not None:
                out.prompt_first_token = self.tokenizer.token_text(self.first_prompt_id)
        return None if self._empty(out) else out

    def on_final(self, final: TokenFinal) -> tuple[TextDelta | None, TextFinal]:
        """Release held text and build the final frame from the engine's."""
        text = ""
        if not self.stopped:
            text = self.stops.push(self.detok.flush()).text
            text += self.stops.flush()
        out = self._split(text, final=True)
        usage = Usage(prompt_tokens=final.prompt_tokens or self.prompt_tokens,
                      completion_tokens=max(final.completion_tokens, self.completion_tokens),
                      cached_tokens=final.cached_tokens)
        return (None if self._empty(out) else out), TextFinal(
            finish_reason=self._reason(final.finish_reason), usage=usage,
            stop_string=self.stops.matched)

    def stop_final(self) -> TextFinal:
        """The final frame after a stop-string match (the engine is being cancelled)."""
        return TextFinal(finish_reason=self._reason("stop"), usage=Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens),
            stop_string=self.stops.matched)

    def final_error(self, final: TextFinal) -> ErrorInfo | None:
        """The error that replaces `final` when the finished text breaks the request's
        response format (output_check.py); None when it keeps it or was cut short."""
        if self.check is None or final.finish_reason != "stop":
            return None
        return self.check.check("".join(self._content))

    def _reason(self, engine_reason: FinishReason) -> FinishReason:
        reason: FinishReason = "stop" if self.stopped else engine_reason
        calls = (self.tools.calls if self.tools is not None else 0) + (
            self.harmony.calls if self.harmony is not None else 0)
        if reason == "stop" and calls:
            return "tool_calls"
        return reason
