"""Prompt logprobs in the shapes clients read them (the fake tokenizer sends one prompt token per
character, first entry None): OpenAI's legacy `echo` + `logprobs` (the prompt's tokens lead the
choice's logprobs, the first null, offsets into the returned text; what lm-evaluation-harness
slices with `[ctxlen:-1]`), and vLLM's `prompt_logprobs`, streamed or not."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from flotilla.services.gateway.service import GatewayService
from tests.gateway.conftest import chat, decode_events, read_sse
from tests.gateway.schemas import (
    validate_completion,
    validate_completion_chunk,
    validate_openai,
    validate_ours,
)

PROMPT = "abc"
GENERATED = ["Hello", " world", " !"]


def check_legacy_offsets(text: str, logprobs: dict[str, Any]) -> None:
    """OpenAI's legacy contract, independent of how we built it: the tokens spell the text and
    each offset is where its token starts."""
    assert "".join(logprobs["tokens"]) == text
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert text[offset:offset + len(token)] == token


async def test_echo_with_logprobs_puts_the_prompt_tokens_first(client: httpx.AsyncClient,
                                                               model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "echo": True, "logprobs": 2}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    response = r.json()
    validate_completion(response)
    validate_ours("Completion", response)
    [choice] = response["choices"]
    assert choice["text"] == PROMPT + "".join(GENERATED)
    logprobs = choice["logprobs"]
    check_legacy_offsets(choice["text"], logprobs)
    ctxlen = len(PROMPT)  # one token per character
    assert logprobs["tokens"][:ctxlen] == list(PROMPT)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:ctxlen] == [-0.1, -0.2]
    assert logprobs["top_logprobs"][1] == {"b": -0.1, "x": -9.0}
    assert logprobs["token_logprobs"][ctxlen:] == [-0.5] * len(GENERATED)
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked for by name

    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = decode_events(await read_sse(s))
    streamed: dict[str, list[Any]] = {k: [] for k in logprobs}
    for chunk in chunks:
        validate_completion_chunk(chunk)
        validate_ours("Completion", chunk)
        for key, values in (chunk["choices"][0]["logprobs"] or {}).items():
            streamed[key] += values
    assert streamed == logprobs


async def test_echo_without_logprobs_and_logprobs_without_echo(client: httpx.AsyncClient,
                                                               model: str) -> None:
    r = await client.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                   "echo": True})
    [choice] = r.json()["choices"]
    assert choice["text"] == PROMPT + "".join(GENERATED) and choice["logprobs"] is None
    r = await client.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                   "logprobs": 1})
    [choice] = r.json()["choices"]
    assert choice["logprobs"]["tokens"] == GENERATED
    assert choice["logprobs"]["text_offset"] == [0, 5, 11]


async def test_the_sdk_reads_echoed_logprobs(gateway: GatewayService, model: str) -> None:
    oai = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    r = await oai.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1,
                                     max_tokens=3)
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.text_offset is not None
    assert logprobs.tokens[:3] == list(PROMPT) and logprobs.token_logprobs[0] is None
    assert logprobs.text_offset[:4] == [0, 1, 2, 3]


VLLM_PROMPT_LOGPROBS = [
    None,
    {"98": {"logprob": -0.1, "rank": 1, "decoded_token": "b"},
     "120": {"logprob": -9.0, "rank": 2, "decoded_token": "x"}},
    {"99": {"logprob": -0.2, "rank": 1, "decoded_token": "c"},
     "120": {"logprob": -9.0, "rank": 2, "decoded_token": "x"}},
]


async def test_vllm_prompt_logprobs_on_completions(client: httpx.AsyncClient,
                                                   model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "prompt_logprobs": 2, "n": 2}
    r = await client.post("/v1/completions", json=body)
    response = r.json()
    validate_completion(response)
    validate_ours("Completion", response)
    for choice in response["choices"]:
        assert choice["prompt_logprobs"] == VLLM_PROMPT_LOGPROBS
        assert choice["text"] == "".join(GENERATED) and choice["logprobs"] is None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = decode_events(await read_sse(s))
    carried = [c["choices"][0] for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert sorted(c["index"] for c in carried) == [0, 1]
    assert all(c["prompt_logprobs"] == VLLM_PROMPT_LOGPROBS for c in carried)


async def test_vllm_prompt_logprobs_on_chat(client: httpx.AsyncClient, model: str) -> None:
    body = chat(model, PROMPT, tools=[], prompt_logprobs=2)
    r = await client.post("/v1/chat/completions", json=body)
    response = r.json()
    validate_openai("CreateChatCompletionResponse", response)
    validate_ours("ChatCompletion", response)
    assert response["prompt_logprobs"] == VLLM_PROMPT_LOGPROBS
    assert response["choices"][0]["message"]["content"] == "".join(GENERATED)
    async with client.stream("POST", "/v1/chat/completions",
                             json={**body, "stream": True}) as s:
        chunks = decode_events(await read_sse(s))
    for chunk in chunks:
        validate_openai("CreateChatCompletionStreamResponse", chunk)
        validate_ours("ChatCompletionChunk", chunk)
    assert [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c] == [
        VLLM_PROMPT_LOGPROBS]
