"""Reasoning blocks of the 2025-26 families: Gemma 4's `<|channel>thought ... <channel|>` (the
tags its real chat template writes) splits like `<think>` does, the same for every split of
the reply; the `<think>` families (GLM-4.5+, Qwen3.5, SmolLM3) keep the tags their templates
write."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.services.tokenizer.reasoning import TAGS, ReasoningParser, Tags

GEMMA4 = TAGS[1]


def split(tags: Tags, pieces: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(in_reasoning, tags)
    got = [parser.push(p) for p in pieces] + [parser.flush()]
    return "".join(g.reasoning for g in got), "".join(g.content for g in got)


@pytest.mark.parametrize("template,tags", [
    ("google-gemma-4-31B-it", GEMMA4), ("GLM-4.6", TAGS[0]), ("GLM-4.7-Flash", TAGS[0]),
    ("Qwen3.5-4B", TAGS[0]), ("HuggingFaceTB-SmolLM3-3B", TAGS[0])])
def test_the_tags_are_the_templates_own(llama_cpp_templates: Path, template: str,
                                        tags: Tags) -> None:
    source = (llama_cpp_templates / f"{template}.jinja").read_text(encoding="utf-8")
    assert tags.start.strip() in source and tags.end in source
    if tags is GEMMA4:  # thinking off: the prompt holds the empty block, as the template writes
        pytest.importorskip("transformers")
        from transformers.utils.chat_template_utils import render_jinja_template

        out, _ = render_jinja_template([[{"role": "user", "content": "hi"}]],
                                       chat_template=source, add_generation_prompt=True,
                                       enable_thinking=False, bos_token="<bos>")
        assert out[0].endswith(tags.start + tags.end)


@pytest.mark.parametrize("reply,expected", [
    ("<|channel>thought\nLet me think.<channel|>The answer.", ("Let me think.", "The answer.")),
    ("No reasoning at all.", ("", "No reasoning at all.")),
    ("<|channel>thought\ncut short", ("cut short", "")),
    ("  <|channel>thought\nx<channel|>\n\ny", ("x", "y")),
])
def test_gemma4_examples(reply: str, expected: tuple[str, str]) -> None:
    for pieces in ([reply], list(reply)):
        assert split(GEMMA4, pieces) == expected


def test_gemma4_prompt_that_opens_the_block() -> None:
    assert split(GEMMA4, ["still thinking<channel|>done"], in_reasoning=True) == (
        "still thinking", "done")


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.sampled_from(["<|channel>", "thought\n", "<channel|>", "<|chan",
                                       "nel|>", "x", " ", "\n", "é"]), max_size=15),
       cuts=st.lists(st.integers(0, 10**4), max_size=8), opened=st.booleans())
def test_same_however_split(parts: list[str], cuts: list[int], opened: bool) -> None:
    text = "".join(parts)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert split(GEMMA4, pieces, opened) == split(GEMMA4, [text], opened)
