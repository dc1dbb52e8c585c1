"""Fill-in-the-middle prompts (`suffix` on /v1/completions), from the vocabulary's FIM tokens.

Rules:
- The tokens are found by their texts, the lists llama.cpp uses (llama-vocab.cpp): StarCoder /
  Granite `<fim_prefix>`, Qwen2.5-Coder / CodeGemma `<|fim_prefix|>`, DeepSeek-Coder
  `<｜fim▁begin｜>` (its hole is the suffix marker, its end the middle), CodeLlama `▁<PRE>`,
  GLM-4 `<|code_prefix|>`, and the `<fim-prefix>` spelling; one of each of prefix, suffix and
  middle must exist, else the request is refused (400 naming `suffix`).
- The prompt is built from ids, as llama.cpp's infill does: the tokens a bare prompt starts with
  (BOS where the model adds one), prefix marker, the prompt's tokens, suffix marker, the
  suffix's tokens, middle marker; the model writes the middle.
"""

from __future__ import annotations

from typing import NamedTuple

from flotilla.libs.common.errors import invalid_request
from flotilla.services.tokenizer.tokenizer import Tokenizer

_PREFIX = ("<|fim_prefix|>", "<fim-prefix>", "<｜fim▁begin｜>", "<fim_prefix>", "<PRE>", "▁<PRE>",
           "<|code_prefix|>")
_SUFFIX = ("<|fim_suffix|>", "<fim-suffix>", "<｜fim▁hole｜>", "<fim_suffix>", "<SUF>", "▁<SUF>",
           "<|code_suffix|>")
_MIDDLE = ("<|fim_middle|>", "<fim-middle>", "<｜fim▁end｜>", "<fim_middle>", "<MID>", "▁<MID>",
           "<|code_middle|>")


class FimTokens(NamedTuple):
    prefix: int
    suffix: int
    middle: int


def _find(tokenizer: Tokenizer, texts: tuple[str, ...]) -> int | None:
    for text in texts:
        token_id = tokenizer.backend.token_to_id(text)
        if token_id is not None:
            return int(token_id)
    return None


def fim_tokens(tokenizer: Tokenizer) -> FimTokens | None:
    """The vocabulary's FIM tokens, or None when it lacks any of the three."""
    ids = [_find(tokenizer, texts) for texts in (_PREFIX, _SUFFIX, _MIDDLE)]
    if any(i is None for i in ids):
        return None
    return FimTokens(*(int(i) for i in ids if i is not None))


def fim_prompt(tokenizer: Tokenizer, tokens: FimTokens | None, prefix: str,
               suffix: str) -> list[int]:
    """The ids of a fill-in-the-middle prompt (see module rules; `tokens`: `fim_tokens`'s
    answer for this tokenizer), or a 400."""
    if tokens is None:
        raise invalid_request("suffix: this model has no fill-in-the-middle tokens",
                              param="suffix", code="invalid_value")
    lead = tokenizer.encode("", add_special_tokens=True)
    return [*lead, tokens.prefix, *tokenizer.encode(prefix, False), tokens.suffix,
            *tokenizer.encode(suffix, False), tokens.middle]
