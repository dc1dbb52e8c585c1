"""Reasoning split over streamed text: any chunking gives what a plain whole-string reading
gives; reasoning and tool calls through the output processor with real token ids (the tool-call
parsers themselves: test_tool_parsers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.libs.common.messages import TextRequest, TokenDelta, TokenFinal
from flotilla.services.tokenizer.output import OutputProcessor
from flotilla.services.tokenizer.reasoning import END, START, ReasoningParser
from flotilla.services.tokenizer.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


def chunked(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def reasoning_reference(text: str, in_reasoning: bool) -> tuple[str, str]:
    """The split read off the whole text at once."""
    if not in_reasoning:
        if not text.lstrip().startswith(START):
            return "", text
        text = text.lstrip()[len(START):]
    idx = text.find(END)
    if idx < 0:
        return text, ""
    return text[:idx], text[idx + len(END):].lstrip("\r\n")


def run_reasoning(pieces: list[str], in_reasoning: bool) -> tuple[str, str]:
    parser = ReasoningParser(in_reasoning)
    splits = [parser.push(p) for p in pieces] + [parser.flush()]
    return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)


REPLIES = ["<think>Let me think.\nOK.</think>\n\nThe answer is 4.",
           "  <think>short</think>answer",
           "Lets think: <think> is not at the start",
           "<think>cut off by max_tokens",
           "No reasoning at all",
           "<thinking>close, but not the tag</thinking>",
           "\n\n"]


@settings(max_examples=300, deadline=None)
@given(reply=st.sampled_from(REPLIES), in_reasoning=st.booleans(),
       cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=8))
def test_reasoning_split_is_chunking_independent(reply: str, in_reasoning: bool,
                                                 cuts: list[int]) -> None:
    text = reply if not in_reasoning else reply.replace(START, "", 1)
    assert run_reasoning(chunked(text, cuts), in_reasoning) == \
        reasoning_reference(text, in_reasoning)


def test_reasoning_examples() -> None:
    assert run_reasoning([REPLIES[0]], False) == ("Let me think.\nOK.", "The answer is 4.")
    assert run_reasoning(["Let me", " think.</th", "ink>\nFour."], True) == \
        ("Let me think.", "Four.")
    assert run_reasoning(["<th", "is is content"], False) == ("", "<this is content")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def thinking_tokenizer(hf_reference, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """SmolLM2's vocabulary plus `<think>` / `</think>` as added tokens (as Qwen3 has them)."""
    import copy

    ref = copy.deepcopy(hf_reference)
    ref.add_tokens(["<think>", "</think>"])
    path: Path = tmp_path_factory.mktemp("thinking")
    ref.save_pretrained(path)
    return Tokenizer.from_path(path)


def test_processor_splits_reasoning_and_tool_calls(thinking_tokenizer: Tokenizer) -> None:
    tok = thinking_tokenizer
    reply = "<think>The user wants weather.</think>\n\n" + CALL
    ids = tok.encode(reply, add_special_tokens=False) + tok.encode("<|im_end|>", False)
    assert ids.count(tok.encode("<think>", False)[0]) == 1
    req = TextRequest(request_id="r", model="m", kind="chat", stream_subject="s",
                      messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
    proc = OutputProcessor.for_request(tok, req, prompt="<|im_start|>assistant\n",
                                       prompt_tokens=9)
    deltas = [d for i in ids if (d := proc.on_tokens(TokenDelta(token_ids=[i])))]
    last, final = proc.on_final(TokenFinal(finish_reason="stop", prompt_tokens=9,
                                           completion_tokens=len(ids)))
    deltas += [last] if last else []
    assert "".join(d.reasoning for d in deltas) == "The user wants weather."
    assert "".join(d.text for d in deltas) == ""
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].id and calls[0].name == "get_weather"
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Paris"}
    assert final.finish_reason == "tool_calls"


def test_processor_without_think_tokens_leaves_text_alone(smollm2: Tokenizer) -> None:
    req = TextRequest(request_id="r", model="m", kind="chat", stream_subject="s",
                      messages=[{"role": "user", "content": "x"}])
    proc = OutputProcessor.for_request(smollm2, req, prompt="", prompt_tokens=1)
    assert proc.reasoning is None and proc.tools is None
    ids = smollm2.encode("<think>not a reasoning model</think>", add_special_tokens=False)
    delta = proc.on_tokens(TokenDelta(token_ids=ids))
    assert delta is not None and delta.text == "<think>not a reasoning model</think>"
