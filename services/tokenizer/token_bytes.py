"""What bytes each token id stands for, so text can be rebuilt token by token.

Detokenizing a stream one token at a time with a tokenizer's `decode` loses leading spaces
(sentencepiece strips them) and splits multi-byte characters. Instead every id maps to its exact
bytes once, at load time; output text is the UTF-8 decoding of the concatenated bytes, which is
the same whether the ids arrive one by one or all at once.

- Byte-level BPE (GPT-2 family): a token is spelled in GPT-2's printable byte alphabet; map each
  character back to its byte.
- Sentencepiece-style (Metaspace / `▁`, byte fallback `<0xNN>`): `▁` is a space, `<0xNN>` one byte.
- Added tokens (special or user-defined) stand for their literal text.
"""

from __future__ import annotations

import functools
import re

SPIECE_SPACE = "\u2581"
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (as in openai/gpt-2 encoder.py)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def byte_level_bytes(token: str) -> bytes:
    """Bytes of a byte-level BPE token; characters outside the alphabet are taken literally."""
    table = unicode_to_bytes()
    if all(c in table for c in token):
        return bytes(table[c] for c in token)
    return token.encode("utf-8")


def byte_level_spelling(text: str) -> str:
    """`text` spelled in the byte alphabet (how a byte-level vocabulary stores it)."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def sentencepiece_bytes(token: str, byte_fallback: bool = True) -> bytes:
    """Bytes of a sentencepiece-style token: `▁` is a space, `<0xNN>` a raw byte."""
    if byte_fallback and (m := _BYTE_FALLBACK.match(token)):
        return bytes([int(m.group(1), 16)])
    return token.replace(SPIECE_SPACE, " ").encode("utf-8")
