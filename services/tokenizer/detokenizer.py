"""Incremental detokenization: token ids in, text out, never half a character.

Each id maps to its exact bytes (`Tokenizer.token_bytes`); the bytes go through an incremental
UTF-8 decoder, which holds back the bytes of a character whose remaining bytes have not arrived
yet (byte-level BPE splits emoji and CJK across tokens). The concatenation of everything `push`
and `flush` return equals `tokenizer.decode(all_ids)`: leading spaces are kept (the output is
the continuation of the prompt) and special tokens contribute nothing.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from flotilla.services.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """One per generated sequence. Not thread-safe; feed ids in order."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 keep_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep_ids = keep_ids  # special tokens shown anyway (reasoning tags for the parser)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_tokens = 0

    def push(self, token_ids: Iterable[int]) -> str:
        """Text completed by these tokens (may be empty while a character is incomplete)."""
        data = bytearray()
        for tid in token_ids:
            skip = self.skip_special_tokens and tid not in self.keep_ids
            data += self.tokenizer.bytes_of(tid, skip)
            self.num_tokens += 1
        return self._decoder.decode(bytes(data), final=False)

    def flush(self) -> str:
        """The end of the stream: bytes of an unfinished character become U+FFFD."""
        return self._decoder.decode(b"", final=True)
