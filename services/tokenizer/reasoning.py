"""Splitting a reasoning model's `<think>...</think>` text from its answer, while streaming.
Gemma 4 writes the same block as `<|channel>thought\n...<channel|>` (`TAGS` lists the pairs).

Rules:
- Reasoning exists only at the start of a reply: the reply opens with `<think>` (after optional
  whitespace), or the prompt already ends with `<think>` (templates that open the block for the
  model). Text after `</think>` is content, with the newlines right after the tag dropped.
- A reply that never opens the block is all content; a block cut short (max_tokens) is all
  reasoning. The tags themselves are never emitted.
- Partial tags are held back until the next piece decides them (like stop strings).
Enabled only for vocabularies that have both tags' control tokens as single tokens (see
`tags_of`).
"""

from __future__ import annotations

from typing import NamedTuple

from flotilla.services.tokenizer.stop_strings import partial_suffix
from flotilla.services.tokenizer.tokenizer import Tokenizer

START, END = "<think>", "</think>"


class Tags(NamedTuple):
    start: str  # the text opening the block
    end: str  # the text closing it
    token: str  # the control token `start` begins with


TAGS = (Tags(START, END, START), Tags("<|channel>thought\n", "<channel|>", "<|channel>"))


def tags_of(tokenizer: Tokenizer) -> tuple[Tags | None, frozenset[int]]:
    """The first pair of `TAGS` whose control tokens are each one token of this vocabulary,
    and their ids (None and empty when none is)."""
    for tags in TAGS:
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in (tags.token, tags.end)]
        if all(len(i) == 1 for i in ids):
            return tags, frozenset(i[0] for i in ids)
    return None, frozenset()


class Split(NamedTuple):
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    def __init__(self, in_reasoning: bool = False, tags: Tags = TAGS[0]):
        self.in_reasoning = in_reasoning  # the prompt opened the block
        self.start, self.end = tags.start, tags.end
        self._state = "reasoning" if in_reasoning else "start"
        self._buf = ""
        self._strip_newlines = False

    @staticmethod
    def tag_ids(tokenizer: Tokenizer) -> frozenset[int]:
        """Ids of the block's control tokens in this vocabulary (empty: no reasoning block)."""
        return tags_of(tokenizer)[1]

    @classmethod
    def for_prompt(cls, tokenizer: Tokenizer, prompt: str) -> ReasoningParser | None:
        tags, _ = tags_of(tokenizer)
        if tags is None:
            return None
        opened = prompt.endswith(tags.start) or prompt.rstrip().endswith(tags.start.rstrip())
        return cls(in_reasoning=opened, tags=tags)

    def push(self, text: str) -> Split:
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(self.start):
                self._state, self._buf = "reasoning", stripped[len(self.start):]
            elif not stripped or self.start.startswith(stripped):
                return Split()  # only whitespace or a partial opening tag so far
            else:
                self._state = "content"
        if self._state == "reasoning":
            idx = self._buf.find(self.end)
            if idx < 0:
                keep = partial_suffix(self._buf, [self.end])
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[
                    len(self._buf) - keep:]
                return Split(reasoning=reasoning)
            reasoning = self._buf[:idx]
            self._buf = self._buf[idx + len(self.end):]
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
