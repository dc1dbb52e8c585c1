"""The official openai SDK against a suite started by `flotilla up` with the real SmolLM2 model."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from tests.e2e.conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def test_models_list(client) -> None:
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids


def test_chat_answers_paris(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                       max_tokens=16)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_non_stream(client) -> None:
    kw = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].usage is not None and not chunks[-1].choices


def test_completions(client) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text.strip()
    assert r.usage.completion_tokens >= 1


def test_eight_concurrent_streams(client) -> None:
    """8 concurrent streams all complete, each in order. Order is checked on content that has
    one right order: each prompt starts a different run of numbers that the model continues
    (greedy), so a stream whose chunks were reordered, lost or mixed with another stream's would
    not read as the next consecutive numbers. (Comparing with the same request run alone would
    test numerics instead: batched CPU decoding is not bit-identical to batch 1.)"""
    starts = [10 * i for i in range(1, 9)]

    def stream(start: int) -> tuple[str, list]:
        prompt = ", ".join(str(n) for n in range(start, start + 6)) + ","
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                max_tokens=24, stream=True))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, starts))
    for start, (text, chunks) in zip(starts, results, strict=True):
        assert len(chunks) > 3 and len({c.id for c in chunks}) == 1
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert not any(c.choices[0].finish_reason for c in chunks[:-1] if c.choices)
        numbers = [int(n) for n in re.findall(r"\d+", text)]
        assert len(numbers) >= 4, text
        assert numbers[:4] == list(range(start + 6, start + 10)), text
