"""Build a `Tokenizer` from a Hugging Face model directory.

Reads `tokenizer.json` (the `tokenizers` pipeline, used as is for encoding), `tokenizer_config.json`
(special tokens, chat template), `chat_template.jinja` / `chat_template.json` (newer layout),
`generation_config.json` (extra eos ids) and `config.json` (context length).

Per-id bytes come from the decoder kind: byte-level (GPT-2 family) or sentencepiece-style
(`▁` and `<0xNN>` byte fallback). Other decoders (WordPiece, ...) are not generation tokenizers and
raise `UnsupportedTokenizer`. Sentencepiece tokens keep their `▁` as a space even at the start:
output is the continuation of the prompt, where HF's `decode` of ids alone strips that one space.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from flotilla.services.tokenizer.token_bytes import byte_level_bytes, sentencepiece_bytes
from flotilla.services.tokenizer.tokenizer import SpecialTokens, Tokenizer, UnsupportedTokenizer

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "max_sequence_length")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return {t for d in decoder.get("decoders", []) for t in _decoder_types(d)}
    return {str(decoder.get("type"))}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_templates(root: Path, config: dict[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):  # [{"name": ..., "template": ...}]
        templates.update({t["name"]: t["template"] for t in raw
                          if isinstance(t, dict) and "name" in t and "template" in t})
    if (root / "chat_template.json").exists():
        value = _read_json(root / "chat_template.json").get("chat_template")
        if isinstance(value, str):
            templates["default"] = value
    if (root / "chat_template.jinja").exists():
        templates["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    for extra in sorted((root / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    return templates


def _context_length(config: dict[str, Any]) -> int | None:
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(section.get(key), int):
                return int(section[key])
    return None


def load_hf_dir(root: Path) -> Tokenizer:
    backend = Backend.from_file(str(root / "tokenizer.json"))
    spec = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
    tok_config = _read_json(root / "tokenizer_config.json")
    model_config = _read_json(root / "config.json")
    gen_config = _read_json(root / "generation_config.json")

    kinds = _decoder_types(spec.get("decoder"))
    byte_fallback = bool(spec.get("model", {}).get("byte_fallback"))
    to_bytes: Callable[[str], bytes]
    if "ByteLevel" in kinds:
        to_bytes = byte_level_bytes
    elif kinds & {"Metaspace", "Replace", "ByteFallback"}:
        fallback = byte_fallback or "ByteFallback" in kinds
        to_bytes = functools.partial(sentencepiece_bytes, byte_fallback=fallback)
    else:
        raise UnsupportedTokenizer(
            f"{root}: tokenizer decoder {sorted(kinds) or 'none'} is not supported for "
            "generation (need byte-level BPE or sentencepiece-style)")

    size = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    token_bytes = []
    for i in range(size):
        if i in added:
            token_bytes.append(added[i].content.encode("utf-8"))
        else:
            tok = backend.id_to_token(i)
            token_bytes.append(to_bytes(tok) if tok is not None else b"")
    special_ids = frozenset(i for i, t in added.items() if t.special)

    def id_of(name: str) -> int | None:
        text = _token_text(tok_config.get(name))
        return backend.token_to_id(text) if text is not None else None

    eos = id_of("eos_token")
    gen_eos = gen_config.get("eos_token_id", model_config.get("eos_token_id"))
    gen_eos_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    if eos is None and gen_eos_ids and isinstance(gen_eos_ids[0], int):
        eos = gen_eos_ids[0]
    specials = SpecialTokens(
        bos=id_of("bos_token"), eos=eos, pad=id_of("pad_token"), unk=id_of("unk_token"),
        extra_eos=tuple(i for i in gen_eos_ids if isinstance(i, int) and i != eos),
    )
    return Tokenizer(
        backend=backend,
        token_bytes=token_bytes,
        special_ids=special_ids,
        specials=specials,
        chat_templates=_chat_templates(root, tok_config),
        max_model_len=_context_length(model_config),
        source=str(root),
    )
