"""Splitting a reasoning model's `<think>...</think>` text from its answer, while streaming.

Rules:
- Reasoning exists only at the start of a reply: the reply opens with `<think>` (after optional
  whitespace), or the prompt already ends with `<think>` (templates that open the block for the
  model). Text after `</think>` is content, with the newlines right after the tag dropped.
- A reply that never opens the block is all content; a block cut short (max_tokens) is all
  reasoning. The tags themselves are never emitted.
- Partial tags are held back until the next piece decides them (like stop strings).
Enabled only for vocabularies that have both tags as single tokens (see `for_tokenizer`).
"""

from __future__ import annotations

from typing import NamedTuple

from services.tokenizer.stop_strings import partial_suffix
from services.tokenizer.tokenizer import Tokenizer

START, END = "<think>", "</think>"


class Split(NamedTuple):
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    def __init__(self, in_reasoning: bool = False):
        self.in_reasoning = in_reasoning  # the prompt opened the block
        self._state = "reasoning" if in_reasoning else "start"
        self._buf = ""
        self._strip_newlines = False

    @staticmethod
    def tag_ids(tokenizer: Tokenizer) -> frozenset[int]:
        """Ids of the two tags when each is one token of this vocabulary, else empty."""
        ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
        return frozenset(i[0] for i in ids) if all(len(i) == 1 for i in ids) else frozenset()

    @classmethod
    def for_prompt(cls, tokenizer: Tokenizer, prompt: str) -> ReasoningParser | None:
        if not cls.tag_ids(tokenizer):
            return None
        return cls(in_reasoning=prompt.rstrip().endswith(START))

    def push(self, text: str) -> Split:
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(START):
                self._state, self._buf = "reasoning", stripped[len(START):]
            elif not stripped or START.startswith(stripped):
                return Split()  # only whitespace or a partial `<think>` so far
            else:
                self._state = "content"
        if self._state == "reasoning":
            idx = self._buf.find(END)
            if idx < 0:
                keep = partial_suffix(self._buf, [END])
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[
                    len(self._buf) - keep:]
                return Split(reasoning=reasoning)
            reasoning = self._buf[:idx]
            self._buf = self._buf[idx + len(END):]
            self._state, self._strip_newlines = "content", True
        if self._strip_newlines:
            self._buf = self._buf.lstrip("\r\n")
            self._strip_newlines = not self._buf
        content, self._buf = self._buf, ""
        return Split(reasoning=reasoning, content=content)

    def flush(self) -> Split:
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            return Split(reasoning=buf)
        return Split(content=buf)
