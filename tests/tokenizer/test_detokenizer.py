"""Incremental detokenization with the real SmolLM2 vocabulary: any split of the token stream
gives the full decode (transformers' decode is the reference there), never half a character."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.services.tokenizer.detokenizer import IncrementalDetokenizer
from flotilla.services.tokenizer.tokenizer import Tokenizer

MULTIBYTE = ["🤖", "🇫🇷", "👩‍👩‍👧", "é", "ü", "日本語", "한국어", "русский", "ελληνικά", "€", "𝔘𝔫𝔦",
             "漢字かな", " ", "  ", "\n", "hello", " world", ",", "🎉🎉", "ﬁ", "\u200b", "ä̈"]


def _stream(tok: Tokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    pieces, start = [], 0
    for cut in sorted(set(cuts)) + [len(ids)]:
        pieces.append(detok.push(ids[start:cut]))
        start = cut
    pieces.append(detok.flush())
    return pieces


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.sampled_from(MULTIBYTE), min_size=1, max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=10))
def test_random_splits_equal_full_decode(smollm2: Tokenizer, hf_reference, parts: list[str],
                                         cuts: list[int]) -> None:
    text = "".join(parts)
    ids = smollm2.encode(text, add_special_tokens=False)
    pieces = _stream(smollm2, ids, [c for c in cuts if c <= len(ids)])
    assert "".join(pieces) == text == hf_reference.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_one_token_at_a_time_never_splits_a_character(smollm2: Tokenizer) -> None:
    text = "🤖 says 日本語 and 🇫🇷!"
    ids = smollm2.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # byte-level BPE really splits these characters
    detok = IncrementalDetokenizer(smollm2)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert "" in pieces  # some tokens completed no character and were held back
    assert all("\ufffd" not in p for p in pieces)


def test_leading_spaces_are_kept_token_by_token(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("Hello world  again", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2)
    pieces = [detok.push([i]) for i in ids]
    assert pieces[1].startswith(" ")
    assert "".join(pieces) == "Hello world  again"


def test_special_tokens_are_not_output(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == "hi"


def test_truncated_character_becomes_replacement_only_at_the_end(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("🤖", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(smollm2)
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == "\ufffd"
