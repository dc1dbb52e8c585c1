"""Every parameter the gateway honours reaches the tokenizer's TextRequest / SamplingOptions as the
contract in libs/common/messages.py says, whatever its spelling (OpenAI, vLLM, llama.cpp); every
parameter accepted without effect leaves the TextRequest exactly as it was without it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from flotilla.libs.common.messages import TextRequest
from tests.gateway.conftest import chat, decode_events, read_sse
from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_openai


async def sent(client: httpx.AsyncClient, tokenizer: FakeTokenizer, path: str,
               body: dict[str, Any]) -> list[TextRequest]:
    """POST `body`; the TextRequests the tokenizer got for it, in choice order."""
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    rid = r.json()["id"].split("-", 1)[1]
    return sorted((q for q in tokenizer.requests if q.request_id.startswith(rid + "-")),
                  key=lambda q: int(q.request_id.rsplit("-", 1)[1]))


async def test_vllm_sampling_and_text_options_reach_the_tokenizer(
        client: httpx.AsyncClient, model: str, tokenizer: FakeTokenizer) -> None:
    body = chat(model, tools=[], logit_bias={"50256": -100, "7": 5.5}, min_tokens=3,
                stop_token_ids=[2, 9], skip_special_tokens=False,
                include_stop_str_in_output=True, ignore_eos=True, prompt_logprobs=2,
                priority=-5, echo=True, max_completion_tokens=20)
    [req] = await sent(client, tokenizer, "/v1/chat/completions", body)
    s = req.sampling
    assert s.logit_bias == {50256: -100.0, 7: 5.5}
    assert (s.min_tokens, s.stop_token_ids, s.ignore_eos, s.prompt_logprobs) == (3, [2, 9], True, 2)
    assert (req.skip_special_tokens, req.include_stop_str_in_output) == (False, True)
    assert (req.priority, req.echo, s.max_tokens) == (-5, True, 20)
    [req] = await sent(client, tokenizer, "/v1/chat/completions", chat(model, logit_bias={}))
    assert req.sampling.logit_bias == {} and req.priority == 0 and req.skip_special_tokens
    validate_openai("CreateChatCompletionRequest", chat(model, logit_bias={"50256": -100}))


async def test_completion_options_reach_the_tokenizer(client: httpx.AsyncClient, model: str,
                                                      tokenizer: FakeTokenizer) -> None:
    body = {"model": model, "prompt": "x", "suffix": "tail", "logit_bias": {"3": 1},
            "min_tokens": 2, "stop_token_ids": [5], "priority": 3, "n_predict": 9,
            "include_stop_str_in_output": True, "skip_special_tokens": False}
    [req] = await sent(client, tokenizer, "/v1/completions", body)
    assert (req.suffix, req.priority, req.include_stop_str_in_output) == ("tail", 3, True)
    s = req.sampling
    assert (s.logit_bias, s.min_tokens, s.stop_token_ids, s.max_tokens) == ({3: 1.0}, 2, [5], 9)
    assert s.prompt_logprobs is None and not req.echo


@pytest.mark.parametrize("extra,expected", [
    ({}, 16),  # OpenAI's default for /v1/completions
    ({"max_tokens": 5}, 5),
    ({"n_predict": 7}, 7),
    ({"n_predict": -1}, None),  # llama.cpp: as many as fit the context
])
async def test_n_predict_is_llama_cpps_max_tokens(client: httpx.AsyncClient, model: str,
                                                  tokenizer: FakeTokenizer, extra: dict,
                                                  expected: int | None) -> None:
    [req] = await sent(client, tokenizer, "/v1/completions",
                       {"model": model, "prompt": "x", **extra})
    assert req.sampling.max_tokens == expected


@pytest.mark.parametrize("extra,expected", [
    ({"echo": True, "logprobs": 2}, 2),  # OpenAI's legacy echo: the prompt's logprobs too
    ({"echo": True, "logprobs": 0}, 0),
    ({"echo": False, "logprobs": 2}, None),
    ({"echo": True}, None),
    ({"prompt_logprobs": 4}, 4),
    ({"prompt_logprobs": 1, "echo": True, "logprobs": 3}, 3),  # the larger k serves both
])
async def test_prompt_logprobs_are_asked_for_echo_and_prompt_logprobs(
        client: httpx.AsyncClient, model: str, tokenizer: FakeTokenizer, extra: dict,
        expected: int | None) -> None:
    [req] = await sent(client, tokenizer, "/v1/completions",
                       {"model": model, "prompt": "abc", **extra})
    assert req.sampling.prompt_logprobs == expected


@pytest.mark.parametrize("extra,add,cont", [
    ({}, True, False),
    ({"add_generation_prompt": False}, False, False),
    ({"continue_final_message": True}, False, True),  # continuing opens no new turn
    ({"continue_final_message": True, "add_generation_prompt": False}, False, True),
])
async def test_generation_prompt_options(client: httpx.AsyncClient, model: str,
                                         tokenizer: FakeTokenizer, extra: dict, add: bool,
                                         cont: bool) -> None:
    body = {"model": model, "tools": [], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}],
        **extra}
    [req] = await sent(client, tokenizer, "/v1/chat/completions", body)
    assert (req.add_generation_prompt, req.continue_final_message) == (add, cont)


@pytest.mark.parametrize("effort,expected", [
    ("none", "none"), ("minimal", "minimal"), ("low", "low"), ("medium", "medium"),
    ("high", "high"), ("xhigh", "high"), ("max", "high"), (None, None)])
async def test_reasoning_effort(client: httpx.AsyncClient, model: str, tokenizer: FakeTokenizer,
                                effort: str | None, expected: str | None) -> None:
    body = chat(model, reasoning_effort=effort, chat_template_kwargs={"enable_thinking": True})
    [req] = await sent(client, tokenizer, "/v1/chat/completions", body)
    assert req.reasoning_effort == expected
    assert req.chat_template_kwargs == {"enable_thinking": True}


NO_EFFECT_CHAT: dict[str, Any] = {
    "user": "u-1", "metadata": {"run": "7"}, "store": True, "service_tier": "flex",
    "prompt_cache_key": "k", "safety_identifier": "s", "cache_prompt": True,
    "prediction": {"type": "content", "content": "Hello world !"}, "verbosity": "medium",
    "modalities": ["text"], "audio": None, "web_search_options": None, "moderation": None,
    "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
    "guided_decoding_backend": "xgrammar", "stream": True,
    "stream_options": {"include_usage": True, "include_obfuscation": True}}
NO_EFFECT_COMPLETION: dict[str, Any] = {
    "user": "u-1", "metadata": {"run": "7"}, "store": False, "service_tier": "auto",
    "prompt_cache_key": "k", "safety_identifier": "s", "cache_prompt": False,
    "guided_decoding_backend": "outlines"}


def _comparable(req: TextRequest) -> dict[str, Any]:
    return req.model_dump(exclude={"request_id", "stream_subject", "deadline"})


async def test_fields_without_effect_change_nothing(client: httpx.AsyncClient, model: str,
                                                    tokenizer: FakeTokenizer) -> None:
    base = chat(model, tools=[], stream=True)
    [plain] = await sent_stream(client, tokenizer, base)
    [rich] = await sent_stream(client, tokenizer, {**base, **NO_EFFECT_CHAT})
    assert _comparable(rich) == _comparable(plain)
    body = {"model": model, "prompt": "x"}
    [plain] = await sent(client, tokenizer, "/v1/completions", body)
    [rich] = await sent(client, tokenizer, "/v1/completions", {**body, **NO_EFFECT_COMPLETION})
    assert _comparable(rich) == _comparable(plain)


async def sent_stream(client: httpx.AsyncClient, tokenizer: FakeTokenizer,
                      body: dict[str, Any]) -> list[TextRequest]:
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        chunks = decode_events(await read_sse(r))
    rid = chunks[0]["id"].removeprefix("chatcmpl-")
    return [q for q in tokenizer.requests if q.request_id.startswith(rid + "-")]


async def test_legacy_functions_become_tools(client: httpx.AsyncClient, model: str,
                                             tokenizer: FakeTokenizer) -> None:
    fn = {"name": "get_weather", "description": "weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    body = chat(model, functions=[fn], function_call={"name": "get_weather"})
    validate_openai("CreateChatCompletionRequest", body)
    [req] = await sent(client, tokenizer, "/v1/chat/completions", body)
    assert req.tools == [{"type": "function", "function": fn}]
    assert req.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert req.parallel_tool_calls is False  # a legacy reply makes one call at most
    [req] = await sent(client, tokenizer, "/v1/chat/completions",
                       chat(model, functions=[fn], function_call="none"))
    assert req.tool_choice == "none"


async def test_allowed_tools_offer_only_the_named_tools(client: httpx.AsyncClient, model: str,
                                                        tokenizer: FakeTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b", "c")]
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "c"}},
        {"type": "function", "function": {"name": "a"}}]}}
    body = chat(model, tools=tools, tool_choice=choice)
    validate_openai("CreateChatCompletionRequest", body)
    [req] = await sent(client, tokenizer, "/v1/chat/completions", body)
    assert req.tools == [tools[2], tools[0]] and req.tool_choice == "required"
