"""GGUF tokenizers against independent references: transformers' GGUF loader on the real SmolLM2
file, gguf.GGUFReader for the metadata, and llama.cpp's golden tokenizations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flotilla.services.tokenizer.bpe_splits import bpe_split
from flotilla.services.tokenizer.gguf_metadata import read_gguf_metadata
from flotilla.services.tokenizer.tokenizer import Tokenizer, UnsupportedTokenizer

VARIED_TEXTS = [
    "Hello world",
    "Hello 12345 world, 3.14159 and 1,000,000",
    "I'm sure they've said we'll, can't, DON'T",
    "  two leading spaces\t\ttabs\n\n\nthree newlines",
    "   spaces at both ends   ",
    "emoji 🤖🇫🇷👩‍👩‍👧 and ünïcödé, 日本語のテキスト, 한국어, русский, ελληνικά",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    '{"json": [1, 2, {"nested": null}], "s": "\\u00e9"}',
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>flotilla<file_sep>x<filename>",
    "text<|im_end|>glued<|im_start|>",
    "\u00a0non-breaking\u200bzero-width\u2028line-sep",
    "Ω K ΐ ﬁ ℌ",
    "a" * 300,
    "",
    " ",
    "\n",
]


def test_metadata_reader_matches_gguf_reader(smollm2_path: Path) -> None:
    from gguf import GGUFReader

    ours = read_gguf_metadata(smollm2_path)
    ref = GGUFReader(smollm2_path)
    assert set(ours) == set(ref.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, float):
            assert ours[key] == pytest.approx(value), key
        else:
            assert ours[key] == value, key


def test_smollm2_encodes_like_transformers(smollm2: Tokenizer, hf_reference) -> None:
    for text in VARIED_TEXTS:
        ids = smollm2.encode(text, add_special_tokens=False)
        assert ids == hf_reference.encode(text, add_special_tokens=False), text
        assert smollm2.encode(text, add_special_tokens=True) == hf_reference.encode(text), text
        assert smollm2.decode(ids, skip_special_tokens=False) == hf_reference.decode(ids), text
        assert smollm2.decode(ids) == hf_reference.decode(ids, skip_special_tokens=True), text


def test_smollm2_special_tokens(smollm2: Tokenizer, hf_reference) -> None:
    ids = smollm2.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)
    assert ids == [hf_reference.convert_tokens_to_ids("<|im_start|>"), 4093,
                   hf_reference.convert_tokens_to_ids("<|im_end|>")]
    assert smollm2.eos_token == hf_reference.eos_token == "<|im_end|>"
    assert smollm2.bos_token == hf_reference.bos_token
    im_end = hf_reference.convert_tokens_to_ids("<|im_end|>")
    endoftext = hf_reference.convert_tokens_to_ids("<|endoftext|>")
    assert smollm2.end_of_generation_ids() == [im_end, endoftext]
    assert smollm2.max_model_len == 8192
    assert smollm2.decode(ids) == "user"


def test_hf_directory_loads_like_transformers(hf_reference, tmp_path: Path) -> None:
    """The same vocabulary saved as a Hugging Face directory (tokenizer.json, config, template)."""
    from transformers import AutoTokenizer

    hf_reference.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_path(tmp_path)
    ref = AutoTokenizer.from_pretrained(tmp_path)
    for text in VARIED_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.chat_template() == ref.chat_template
    assert ours.max_model_len == 2048
    assert ours.end_of_generation_ids() == [2, 0]
    assert ours.eos_token == "<|im_end|>"


# ---------------------------------------------------------------- llama.cpp golden files

GOLDEN_BPE = ["gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "refact", "mpt", "falcon",
              "deepseek-coder", "deepseek-llm", "command-r"]


def _golden_cases(vocab: Path, name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 format: inputs split by a separator line, one output line
    of ids per input."""
    raw = (vocab / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    outs = (vocab / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(outs)
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs, strict=True)]


@pytest.mark.parametrize("name", GOLDEN_BPE)
def test_llama_cpp_golden_tokenization(llama_cpp_vocab: Path, name: str) -> None:
    tok = Tokenizer.from_path(llama_cpp_vocab / f"ggml-vocab-{name}.gguf")
    cases = _golden_cases(llama_cpp_vocab, name)
    assert len(cases) > 40
    for text, expected in cases:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == expected, text
        assert tok.decode(ids) == text, text
    if name == "llama-bpe":  # llama.cpp adds BOS to bare prompts of this type
        assert tok.encode("hi")[0] == tok.specials.bos == 128000


@pytest.mark.parametrize("name,kind", [("llama-spm", "'llama'"), ("phi-3", "'llama'"),
                                       ("bert-bge", "'bert'"), ("gemma-4", "'gemma4'")])
def test_unsupported_tokenizer_types_are_refused(llama_cpp_vocab: Path, name: str,
                                                 kind: str) -> None:
    """Sentencepiece (SPM), WordPiece and Gemma vocabularies are not built from GGUF: they must
    fail loudly rather than tokenize wrongly."""
    with pytest.raises(UnsupportedTokenizer, match=f"tokenizer type {kind} is not supported"):
        Tokenizer.from_path(llama_cpp_vocab / f"ggml-vocab-{name}.gguf")


def test_unknown_pre_tokenizer_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'made-up'"):
        bpe_split("made-up")
    assert bpe_split(None) == bpe_split("default")


def test_sentencepiece_hf_directory(llama_cpp_vocab: Path, tmp_path: Path) -> None:
    """A sentencepiece (Metaspace + byte fallback) tokenizer.json, as transformers writes it for
    llama.cpp's Llama-2 vocabulary: same ids; decoding keeps the first token's space."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(llama_cpp_vocab), gguf_file="ggml-vocab-llama-spm.gguf")
    ref.save_pretrained(tmp_path)
    ours = Tokenizer.from_path(tmp_path)
    for text in ["Hello world", "emoji 🤖 日本語 ünï", "a\nb\tc  d", "x" * 50]:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == " " + ref.decode(ids, skip_special_tokens=True), text
