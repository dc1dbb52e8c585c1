"""A reply of each 2026 family, as its real chat template writes the assistant turn (reasoning,
content, two tool calls), through the whole output stage (detokenizer, reasoning split, the tool
format detected from the template): the reasoning comes back as `reasoning`, the content as
text, the calls as tool calls with their arguments, and finish_reason "tool_calls", for the
reply in one delta (non-streaming) and however its tokens are split into deltas (streaming).

The reply is what the reference (transformers' renderer) writes after our own generation
prompt, which must be its prefix. gpt-oss's harmony replies: test_harmony.py (against
openai-harmony). The vocabulary is Qwen3's (`<think>`, `</think>`, `<tool_call>` are control
tokens); for Gemma 4, the same with its control tokens renamed to Gemma 4's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flotilla.libs.common.messages import TextDelta, TextRequest, TokenDelta, TokenFinal
from flotilla.services.tokenizer.chat_template import ChatTemplate
from flotilla.services.tokenizer.output import OutputProcessor
from flotilla.services.tokenizer.tokenizer import Tokenizer
from flotilla.services.tokenizer.tool_formats import detect
from tests.tokenizer.test_real_templates import (
    ASK,
    WEATHER,
    load,
    ours,
    reference_messages,
    with_specials,
)

CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": 'Zürich "q" <b>'})]
TURN = {"role": "assistant", "content": "Checking.", "reasoning_content": "The tool knows.",
        "tool_calls": [{"id": f"call{i}", "type": "function", "function": {
            "name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(CALLS)]}

# template, bos, eos, the format its template implies, whether the reply carries reasoning
FAMILIES = [
    ("google-gemma-4-31B-it", "<bos>", "<turn|>", "gemma4", True),
    ("Qwen3.5-4B", None, "<|im_end|>", "qwen_xml", True),
    ("Qwen3-Coder", None, "<|im_end|>", "qwen_xml", False),
    ("GLM-4.6", "[gMASK]<sop>", "<|endoftext|>", "glm", True),
    ("GLM-4.7-Flash", "[gMASK]<sop>", "<|endoftext|>", "glm", True),
    ("HuggingFaceTB-SmolLM3-3B", None, "<|im_end|>", "hermes", False),  # tools injected
    ("MiniMax-M2", None, "[e~[", "minimax", True),
    ("deepseek-ai-DeepSeek-V3.2", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "dsml",
     True),
]


# Qwen3's control tokens renamed to Gemma 4's (its vocabulary then has no `<think>`)
AS_GEMMA4 = {"<think>": "<|channel>", "</think>": "<channel|>", "<tool_call>": "<|tool_call>",
             "</tool_call>": "<tool_call|>", "<|box_start|>": '<|"|>', "<|im_start|>": "<|turn>",
             "<|im_end|>": "<turn|>", "<tool_response>": "<|tool_response>",
             "</tool_response>": "<tool_response|>"}


@pytest.fixture(scope="module")
def vocab(qwen3_dir: Path) -> Tokenizer:
    return load(qwen3_dir)[0]


@pytest.fixture(scope="module")
def gemma4_vocab(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    spec = json.loads((qwen3_dir / "tokenizer.json").read_text(encoding="utf-8"))
    for token in spec["added_tokens"]:
        token["content"] = AS_GEMMA4.get(token["content"], token["content"])
    path = tmp_path_factory.mktemp("gemma4")
    (path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return Tokenizer.from_path(path)


def splits(n: int) -> list[list[int]]:
    """Ways to cut n token ids into deltas: whole, one by one, and seeded random cuts."""
    ways = [[0, n], list(range(n + 1))]
    for seed in range(6):
        rng = random.Random(seed)
        ways.append(sorted({0, n, *rng.sample(range(1, n), min(n - 1, rng.randint(1, 12)))}))
    return ways


def run(proc: OutputProcessor, ids: list[int], cuts: list[int]) -> tuple[str, str, list, str]:
    deltas: list[TextDelta] = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        if d := proc.on_tokens(TokenDelta(token_ids=ids[a:b])):
            deltas.append(d)
    last, final = proc.on_final(TokenFinal(finish_reason="stop", prompt_tokens=1,
                                           completion_tokens=len(ids)))
    deltas += [last] if last else []
    calls: list[list[str]] = []
    for d in deltas:
        for c in d.tool_calls:
            if c.name is not None:
                assert c.id and c.index == len(calls)
                calls.append([c.name, ""])
            calls[c.index][1] += c.arguments
    return ("".join(d.reasoning for d in deltas), "".join(d.text for d in deltas),
            [(n, json.loads(a)) for n, a in calls], final.finish_reason)


@pytest.mark.parametrize("name,bos,eos,fmt,reasons", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_reply_parses_streamed_and_whole(request: pytest.FixtureRequest,
                                         llama_cpp_templates: Path, name: str, bos: str | None,
                                         eos: str, fmt: str, reasons: bool) -> None:
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (llama_cpp_templates / f"{name}.jinja").read_text(encoding="utf-8")
    template = ChatTemplate(source)
    tool_format = detect(source, template.uses_tools)
    assert tool_format.name == fmt
    vocab = request.getfixturevalue("gemma4_vocab" if fmt == "gemma4" else "vocab")
    tok = with_specials(vocab, bos, eos)
    switch = {"enable_thinking": True} if {"enable_thinking", "thinking"} & template.variables \
        else {}
    prompt = ours(tok, ASK, [WEATHER], template=source, **switch)
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    rendered, _ = render_jinja_template(
        [reference_messages([*ASK, TURN], [WEATHER], source)],
        tools=[WEATHER] if template.uses_tools else None, chat_template=source, **specials,
        **switch)
    full = str(rendered[0])
    assert full.startswith(prompt)
    reply = full[len(prompt):].split(eos)[0].split("<|tool_response>")[0]  # Gemma 4: the
    # turn goes on with the results
    ids = tok.encode(reply, add_special_tokens=False)
    req = TextRequest(request_id="r", model="m", kind="chat", stream_subject="s",
                      messages=ASK, tools=[WEATHER])
    expected = ("The tool knows." if reasons else "", "Checking.", CALLS, "tool_calls")
    for cuts in splits(len(ids)):
        proc = OutputProcessor.for_request(tok, req, prompt, prompt_tokens=1,
                                           tool_format=tool_format)
        reasoning, content, calls, reason = run(proc, ids, cuts)
        assert (reasoning.strip(), content.strip(), calls, reason) == expected, cuts
