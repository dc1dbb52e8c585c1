"""How llama.cpp splits text before byte-level BPE, per `tokenizer.ggml.pre` name.

llama.cpp applies a list of regexes in turn; each splits every piece further and keeps both the
matches and the text between them ("isolated"). Only then are the pieces byte-encoded and merged.
The table mirrors `llm_tokenizer_bpe` in llama.cpp's `llama-vocab.cpp` (pre-type names from its
`tokenizer_pre ==` chain), written in the original Hugging Face regex dialect, which the
`tokenizers` library (Oniguruma) understands. `ignore_merges`: a piece that is itself a vocabulary
token is taken whole (llama3-style tokenizers); `add_bos`: llama.cpp's per-type BOS default.

A name missing here is an error, as in llama.cpp: guessing the split silently degrades output.
"""

from __future__ import annotations

from typing import NamedTuple

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
         r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
         r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
              r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
# Written with escapes: a literal copy gets Unicode-normalized by editors (U+1FD3 -> U+0390),
# which turns ranges such as \u1fd0-\u1fd3 into empty ones.
DEEPSEEK_LLM_LETTERS = (
    "[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


class BpeSplit(NamedTuple):
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_DEFAULT = BpeSplit((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2 = BpeSplit((GPT2,))
_STARCODER = BpeSplit((r"\p{N}", GPT2))
_LLAMA3 = BpeSplit((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = BpeSplit((QWEN2,))

_BY_NAME: dict[tuple[str, ...], BpeSplit] = {
    ("default",): _DEFAULT,
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
     "jina-v5-nano"): _LLAMA3,
    ("dbrx", "smaug-bpe"): BpeSplit((LLAMA3,)),
    ("deepseek-llm",): BpeSplit((r"[\r\n]", r"\s?" + DEEPSEEK_LLM_LETTERS, DEEPSEEK_LLM_PUNCT,
                                 r"\s+$", CJK, r"\p{N}+")),
    ("deepseek-coder",): BpeSplit((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+",
                                   CJK, r"\p{N}")),
    ("falcon",): BpeSplit((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"): _STARCODER,
    ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
     "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais",
     "trillion", "granite-docling", "exaone4"): _GPT2,
    ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"): _QWEN2,
    ("qwen35",): BpeSplit((QWEN35,)),
    ("poro-chat", "bloom", "gpt3-finnish"): BpeSplit((BLOOM,)),
    ("viking",): BpeSplit((BLOOM, r"\p{N}")),
    ("chatglm-bpe",): BpeSplit((LLAMA3,)),
    ("glm4", "glm5"): BpeSplit((LLAMA3,), ignore_merges=True),
    ("tekken",): BpeSplit((TEKKEN,), ignore_merges=True, add_bos=True),
    ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"): BpeSplit((GPT4O,)),
    ("seed-coder",): BpeSplit((SEED_CODER,)),
}
BPE_SPLITS: dict[str, BpeSplit] = {name: split for names, split in _BY_NAME.items()
                                   for name in names}


def bpe_split(pre: str | None) -> BpeSplit:
    """The split for a `tokenizer.ggml.pre` value; a missing value means llama.cpp's default."""
    if not pre:
        return _DEFAULT
    if pre not in BPE_SPLITS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                         f"supported: {', '.join(sorted(BPE_SPLITS))}")
    return BPE_SPLITS[pre]
