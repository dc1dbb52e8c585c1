"""SSE framing of chunks (orjson): each event is `data: <JSON>\n\n` whose JSON has exactly the
chunk's keys and values, with non-ASCII text sent as UTF-8 (as json.dumps(ensure_ascii=False))."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flotilla.libs.common.messages import TextDelta, TextFinal, TextLogprob, ToolCallDelta, Usage
from flotilla.services.gateway.chunks import chunk_builder
from flotilla.services.gateway.plan import chat_plan, completion_plan
from flotilla.services.gateway.sse import DONE, sse

TEXTS = ["Hello", "héllo wörld", "日本語", "🙂 emoji", 'quote " backslash \\ tab \t nl \n',
         "\x00\x1f control", "\u2028 line separator", ""]


def chunks() -> list[dict[str, Any]]:
    chat = chat_plan({"model": "m/é", "messages": [{"role": "user", "content": "x"}],
                      "logprobs": True, "top_logprobs": 2, "n": 2}, None, 4)
    built = chunk_builder(chat, 1_700_000_000)
    out = list(built.opening())
    for text in TEXTS:
        lp = [TextLogprob(token=text or "x", logprob=-1e-05, top=[(text or "x", -1e-05),
                                                                   ("y", -12.375)])]
        out.append(built.delta(0, TextDelta(text=text, reasoning=text, logprobs=lp)))
    out.append(built.delta(1, TextDelta(tool_calls=[ToolCallDelta(
        index=0, id="call_1", name="f", arguments='{"a": "é"}')])))
    usage = Usage(prompt_tokens=3, completion_tokens=5, cached_tokens=1)
    out += [built.final(i, TextFinal(finish_reason="stop", usage=usage)) for i in (0, 1)]
    out.append(built.usage_chunk())
    completion = chunk_builder(completion_plan({"model": "m", "prompt": "x", "logprobs": 1},
                                               4), 1)
    lp = [TextLogprob(token="é", logprob=-0.5, top=[("é", -0.5)])]
    out.append(completion.delta(0, TextDelta(text="é", logprobs=lp)))
    return [c for c in out if c is not None]


@pytest.mark.parametrize("chunk", chunks())
def test_event_carries_the_chunk_exactly(chunk: dict[str, Any]) -> None:
    event = sse(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    payload = event[len(b"data: "):-2]
    assert b"\n" not in payload  # one line per event
    assert json.loads(payload) == chunk
    reference = json.dumps(chunk, ensure_ascii=False)
    assert json.loads(reference) == json.loads(payload)
    for text in TEXTS:  # non-ASCII text travels as UTF-8, not \\u escapes
        if text and text.isprintable() and not text.isascii() and text in reference:
            assert text.encode() in payload


def test_done_event() -> None:
    assert DONE == b"data: [DONE]\n\n"
