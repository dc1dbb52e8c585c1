"""Build a `Tokenizer` from a GGUF file's metadata, the way llama.cpp tokenizes it.

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE: GPT-2, Llama 3, Qwen, SmolLM, ...).
The pieces, as in llama.cpp's `llm_tokenizer_bpe`:
- split with the regex list for `tokenizer.ggml.pre` (bpe_splits.py), then byte-encode and merge
  by `tokenizer.ggml.merges` rank;
- tokens typed CONTROL (and UNKNOWN) are special: matched whole in the text, never shown in
  output; USER_DEFINED tokens are matched whole and shown as their literal text;
- BOS is prepended to bare prompts when `tokenizer.ggml.add_bos_token` (or the type's default) says.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from flotilla.services.tokenizer.bpe_splits import bpe_split
from flotilla.services.tokenizer.gguf_metadata import read_gguf_metadata
from flotilla.services.tokenizer.token_bytes import byte_level_bytes, sentencepiece_bytes
from flotilla.services.tokenizer.tokenizer import SpecialTokens, Tokenizer, UnsupportedTokenizer

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _merge_pairs(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges as pairs; llama.cpp splits at the first space after the first character."""
    pairs, dropped = [], 0
    for merge in merges:
        pos = merge.find(" ", 1)
        if pos < 0:
            dropped += 1
            continue
        a, b = merge[:pos], merge[pos + 1:]
        if a in vocab and b in vocab and a + b in vocab:
            pairs.append((a, b))
        else:
            dropped += 1
    if dropped:
        log.warning("ignored %d GGUF merges whose tokens are not in the vocabulary", dropped)
    return pairs


def build_backend(tokens: list[str], token_types: list[int], merges: list[str],
                  pre: str | None) -> Backend:
    """A `tokenizers` byte-level BPE equivalent to llama.cpp's tokenizer for this vocabulary."""
    split = bpe_split(pre)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=_merge_pairs(merges, vocab),
                     ignore_merges=split.ignore_merges)
    backend = Backend(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in split.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    special = [AddedToken(tok, special=True, normalized=False)
               for tok, tt in zip(tokens, token_types, strict=True) if tt in (CONTROL, UNKNOWN)]
    user = [AddedToken(tok, special=False, normalized=False)
            for tok, tt in zip(tokens, token_types, strict=True) if tt == USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


def _token_bytes(tokens: list[str], token_types: list[int]) -> list[bytes]:
    out = []
    for tok, tt in zip(tokens, token_types, strict=True):
        if tt in (CONTROL, USER_DEFINED, UNKNOWN):
            out.append(tok.encode("utf-8"))
        elif tt == BYTE:
            out.append(sentencepiece_bytes(tok))
        else:
            out.append(byte_level_bytes(tok))
    return out


def _chat_templates(meta: dict[str, Any]) -> dict[str, str]:
    templates = {}
    if isinstance(meta.get("tokenizer.chat_template"), str):
        templates["default"] = meta["tokenizer.chat_template"]
    for name in meta.get("tokenizer.chat_templates") or []:
        value = meta.get(f"tokenizer.chat_template.{name}")
        if isinstance(value, str):
            templates[name] = value
    return templates


def _post_processor(bos: int | None, eos: int | None, add_bos: bool, add_eos: bool,
                    tokens: list[str]) -> processors.TemplateProcessing | None:
    before = [(tokens[bos], bos)] if add_bos and bos is not None else []
    after = [(tokens[eos], eos)] if add_eos and eos is not None else []
    if not before and not after:
        return None
    pre = " ".join(t for t, _ in before)
    post = " ".join(t for t, _ in after)
    return processors.TemplateProcessing(
        single=" ".join(x for x in (pre, "$A", post) if x),
        pair=" ".join(x for x in (pre, "$A", post, pre, "$B", post) if x),
        special_tokens=before + [s for s in after if s not in before],
    )


def load_gguf(path: Path) -> Tokenizer:
    meta = read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedTokenizer(
            f"{path.name}: GGUF tokenizer type {kind!r} is not supported; only byte-level BPE "
            "('gpt2': GPT-2, Llama 3, Qwen, SmolLM, ...). Serve the model's Hugging Face "
            "directory (tokenizer.json) instead.")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if "tokenizer.ggml.merges" not in meta:
        raise UnsupportedTokenizer(f"{path.name}: byte-level BPE vocabulary without merges")
    pre = meta.get("tokenizer.ggml.pre")
    try:
        backend = build_backend(tokens, token_types, meta["tokenizer.ggml.merges"], pre)
    except ValueError as exc:
        raise UnsupportedTokenizer(f"{path.name}: {exc}") from exc

    specials = SpecialTokens(
        bos=meta.get("tokenizer.ggml.bos_token_id"),
        eos=meta.get("tokenizer.ggml.eos_token_id"),
        pad=meta.get("tokenizer.ggml.padding_token_id"),
        unk=meta.get("tokenizer.ggml.unknown_token_id"),
        extra_eos=tuple(i for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                        if isinstance(i := meta.get(key), int)),
    )
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", bpe_split(pre).add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (proc := _post_processor(specials.bos, specials.eos, add_bos, add_eos, tokens)) is not None:
        backend.post_processor = proc

    arch = meta.get("general.architecture", "")
    context = meta.get(f"{arch}.context_length")
    return Tokenizer(
        backend=backend,
        token_bytes=_token_bytes(tokens, token_types),
        special_ids=frozenset(i for i, tt in enumerate(token_types) if tt in (CONTROL, UNKNOWN)),
        specials=specials,
        chat_templates=_chat_templates(meta),
        max_model_len=int(context) if isinstance(context, int) else None,
        source=str(path),
    )
