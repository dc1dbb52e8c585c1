"""The tokenizer one model is served with: text <-> ids, special tokens, chat templates.

A `Tokenizer` is built once per process by `Tokenizer.from_path` (a GGUF file, a Hugging Face model
directory, or a directory holding one GGUF) and is read-only afterwards, so request handlers on any
thread may share it. Encoding runs in the `tokenizers` library; decoding goes through the per-id
byte table (`token_bytes.py`), so a stream decoded token by token equals the whole decoded at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as Backend

from flotilla.libs.common.gguf_files import find_gguf

# Token texts llama.cpp treats as end-of-generation when a vocabulary has them (llama-vocab.cpp).
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<turn|>", "<｜end▁of▁sentence｜>",
})


class UnsupportedTokenizer(ValueError):
    """The model's tokenizer is of a kind this service cannot build."""


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the model's named special tokens (None where the model has none)."""

    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    unk: int | None = None
    extra_eos: tuple[int, ...] = ()  # e.g. generation_config.json's other eos ids


@dataclass(repr=False)
class Tokenizer:
    """Encode/decode for one model, plus what chat rendering and stopping need.

    Rules: ids in `special_ids` are control tokens; they never appear in output text (they may
    appear in prompts, where the chat template writes them). `token_bytes[i]` is the exact byte
    string of id i; decoding is UTF-8 over the concatenation, invalid bytes become U+FFFD.
    """

    backend: Backend
    token_bytes: list[bytes]
    special_ids: frozenset[int]
    specials: SpecialTokens
    chat_templates: dict[str, str] = field(default_factory=dict)
    max_model_len: int | None = None
    source: str = ""

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Load from a `.gguf` file (any part of a split set), a HF model directory
        (tokenizer.json), or a directory with exactly one `.gguf` file or split set.
        Unsupported kinds raise `UnsupportedTokenizer`."""
        p = Path(path)
        if p.is_dir():
            if (p / "tokenizer.json").exists():
                from flotilla.services.tokenizer.hf_loader import load_hf_dir

                return load_hf_dir(p)
            try:
                found = find_gguf(p)
            except ValueError as exc:
                raise UnsupportedTokenizer(f"{p} has no tokenizer.json and {exc}") from exc
            if found is None:
                raise UnsupportedTokenizer(f"{p} has no tokenizer.json and no .gguf file")
            p = found
        elif p.suffix == ".gguf" and p.exists():
            p = find_gguf(p) or p  # a split set's metadata is in its first part
        if not p.exists():
            raise FileNotFoundError(f"no tokenizer at {p}")
        from flotilla.services.tokenizer.gguf_loader import load_gguf

        return load_gguf(p)

    # ------------------------------------------------------------------ ids <-> text

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token texts in `text` (e.g. `<|im_start|>`) become their
        single ids. `add_special_tokens` (as in HF) adds what the model adds to a bare prompt
        (BOS, where the model asks for it); rendered chat prompts pass False."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
        return b"".join(self.bytes_of(i, skip_special_tokens) for i in ids)

    def bytes_of(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        if 0 <= token_id < len(self.token_bytes):
            return self.token_bytes[token_id]
        return b""

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs show it (partial UTF-8 becomes U+FFFD)."""
        return self.bytes_of(token_id, False).decode("utf-8", errors="replace")

    def valid_ids(self, ids: Sequence[int]) -> bool:
        return all(0 <= i < self.vocab_size for i in ids)

    # ------------------------------------------------------------------ special tokens

    def text_of(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < self.vocab_size:
            return None
        return self.token_bytes[token_id].decode("utf-8", errors="replace")

    @property
    def bos_token(self) -> str | None:
        return self.text_of(self.specials.bos)

    @property
    def eos_token(self) -> str | None:
        return self.text_of(self.specials.eos)

    @property
    def special_token_texts(self) -> dict[str, str]:
        """`bos_token`, `eos_token`, ... as chat templates expect them."""
        names = {"bos_token": self.specials.bos, "eos_token": self.specials.eos,
                 "pad_token": self.specials.pad, "unk_token": self.specials.unk}
        return {name: text for name, tid in names.items() if (text := self.text_of(tid))}

    def end_of_generation_ids(self) -> list[int]:
        """Ids that end a reply: the model's eos, its other configured eos ids, and every
        special token whose text marks an end of turn (`<|im_end|>`, `<|eot_id|>`, ...).
        In harmony vocabularies (gpt-oss: they have `<|return|>`), `<|end|>` ends one message of
        a reply (its reasoning, say), not the reply: it is left out."""
        ids = [i for i in (self.specials.eos, *self.specials.extra_eos) if i is not None]
        texts = {tid: self.text_of(tid) for tid in sorted(self.special_ids)}
        harmony = "<|return|>" in texts.values()
        for tid, text in texts.items():
            if text in END_OF_GENERATION_TEXTS and tid not in ids and not (
                    harmony and text == "<|end|>"):
                ids.append(tid)
        return ids

    def chat_template(self, with_tools: bool = False) -> str | None:
        """The model's chat template (the `tool_use` variant for requests with tools, if any)."""
        if with_tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        return self.chat_templates.get("default")
