"""Stop strings over streamed text, checked against a plain `str.find` on the whole text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.libs.common.messages import TokenDelta, TokenFinal
from flotilla.services.tokenizer.output import OutputProcessor
from flotilla.services.tokenizer.stop_strings import StopStringMatcher
from flotilla.services.tokenizer.tokenizer import Tokenizer


def _feed(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopStringMatcher(stops)
    out, stopped = [], False
    for piece in pieces:
        res = m.push(piece)
        out.append(res.text)
        if res.stopped:
            stopped = True
            break
    if not stopped:
        out.append(m.flush())  # may still find a stop in the held text
    return out, m.stopped


def _reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def test_stop_across_pieces_is_held_back_and_not_emitted() -> None:
    out, stopped = _feed(["</answer>"], ["The answer is 42</", "ans", "wer> and more"])
    assert stopped
    assert out == ["The answer is 42", "", ""]


def test_false_start_is_released_once_disambiguated() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.push("go ST").text == "go "
    assert m.held == "ST"
    assert m.push("ART").text == "START"
    assert m.push(" S").text == " "
    assert m.flush() == "S"


def test_earliest_stop_wins_and_overlaps_work() -> None:
    # "b" is complete in "xab", but "abc" would start earlier: held until "c" shows it does
    assert _feed(["abc", "b"], ["xab", "c"]) == (["x", ""], True)
    assert _feed(["abc", "b"], ["xab", "d"]) == (["x", "a"], True)
    assert _feed(["abc", "bd"], ["xab", "c"]) == (["x", ""], True)
    assert _feed(["aab"], ["a", "a", "a", "b", "z"]) == (["", "", "a", ""], True)
    # "a" is complete in " a" but " aa", starting earlier, is still open: wait, then stop there
    assert _feed(["a", " aa"], [" a", "a"]) == (["", ""], True)
    assert _feed(["a", " aa"], [" a", "b"]) == (["", " "], True)
    # the stream ends while the longer stop is open: the held text is cut at the short one
    assert _feed(["a", " aa"], [" a"]) == (["", " "], True)


letters = st.text(alphabet="abc é🤖", max_size=30)


@settings(max_examples=400, deadline=None)
@given(text=letters, stops=st.lists(st.text(alphabet="abc é🤖", min_size=1, max_size=4),
                                     max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8))
def test_random_chunking_matches_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out, stopped = _feed(stops, pieces)
    assert ("".join(out), stopped) == _reference(text, stops)


def test_stop_string_spanning_tokens_with_real_tokenizer(smollm2: Tokenizer) -> None:
    text = "Sure! The capital of France is Paris. Done, goodbye."
    ids = smollm2.encode(text, add_special_tokens=False)
    proc = OutputProcessor(smollm2, stop=["Paris. Do"], prompt_tokens=5)
    emitted = []
    for tid in ids:
        delta = proc.on_tokens(TokenDelta(token_ids=[tid]))
        if delta is not None:
            emitted.append(delta.text)
        if proc.stopped:
            break
    assert proc.stopped
    assert "".join(emitted) == "Sure! The capital of France is "
    assert proc.stop_final().finish_reason == "stop"
    assert proc.stop_final().usage.completion_tokens == proc.completion_tokens < len(ids)


def test_held_text_is_released_at_the_end(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("the end is near", add_special_tokens=False)
    proc = OutputProcessor(smollm2, stop=["near!"])
    text = "".join(d.text for i in ids if (d := proc.on_tokens(TokenDelta(token_ids=[i]))))
    assert text == "the end is "
    delta, final = proc.on_final(TokenFinal(finish_reason="length", prompt_tokens=3,
                                            completion_tokens=len(ids)))
    assert delta is not None and delta.text == "near"
    assert final.finish_reason == "length" and final.usage.completion_tokens == len(ids)


def test_the_matched_stop_string_is_named() -> None:
    """Anthropic's `stop_sequence` names which stop ended the text (pushed or at flush)."""
    m = StopStringMatcher(["abc", "b"])
    m.push("xab")
    assert m.matched is None
    m.push("c")
    assert m.matched == "abc"
    m = StopStringMatcher(["a", " aa"])
    m.push(" a")
    m.flush()
    assert m.matched == "a"
    m = StopStringMatcher(["zz"])
    m.push("no stop here")
    m.flush()
    assert m.matched is None and not m.stopped
