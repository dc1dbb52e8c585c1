"""Message history as the official `openai` SDK sends it back: its documented patterns (parse →
append → next turn, the stream helper's final message, `parse()` with tools, legacy function
calling) pass, and what reaches the tokenizer is the conversation without the output-only
fields."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from flotilla.libs.common.messages import TextRequest
from flotilla.services.gateway.service import GatewayService
from tests.gateway.conftest import chat, decode_events, read_sse
from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_openai, validate_ours

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


class Answer(BaseModel):
    a: int


class GetWeather(BaseModel):
    city: str


@pytest.fixture
def oai(gateway: GatewayService) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def received(tokenizer: FakeTokenizer, response_id: str) -> TextRequest:
    rid = response_id.removeprefix("chatcmpl-")
    return next(q for q in tokenizer.requests if q.request_id.startswith(rid + "-"))


async def test_parse_then_append_then_next_turn(oai: openai.AsyncOpenAI, model: str,
                                                tokenizer: FakeTokenizer) -> None:
    messages: list[Any] = [{"role": "user", "content": "json"}]
    completion = await oai.chat.completions.parse(model=model, messages=messages,
                                                  response_format=Answer)
    assert completion.choices[0].message.parsed == Answer(a=1)
    messages.append(completion.choices[0].message)
    messages.append({"role": "user", "content": "again"})
    reply = await oai.chat.completions.create(model=model, messages=messages)
    assert reply.choices[0].message.content == "Hello world !"
    assert received(tokenizer, reply.id).messages == [
        {"role": "user", "content": "json"}, {"role": "assistant", "content": '{"a": 1}'},
        {"role": "user", "content": "again"}]


async def test_stream_helper_message_sent_back(oai: openai.AsyncOpenAI, model: str,
                                               tokenizer: FakeTokenizer) -> None:
    history: list[Any] = [{"role": "user", "content": "tools"}]
    async with oai.chat.completions.stream(model=model, messages=history, tools=TOOLS) as s:
        async for _ in s:
            pass
        final = await s.get_final_completion()
    message = final.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    history += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                          "content": "sunny"}, {"role": "user", "content": "thanks"}]
    reply = await oai.chat.completions.create(model=model, messages=history, tools=TOOLS)
    sent = received(tokenizer, reply.id).messages
    assert sent is not None
    assert sent[1]["tool_calls"] == [CALL]  # no `index`, no `parsed_arguments`
    assert not {"parsed", "refusal", "annotations", "audio", "function_call"} & set(sent[1])
    assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


async def test_parse_with_a_pydantic_tool_sent_back(oai: openai.AsyncOpenAI, model: str,
                                                    tokenizer: FakeTokenizer) -> None:
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    completion = await oai.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "tools"}], tools=[tool])
    message = completion.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.parsed_arguments == \
        GetWeather(city="Paris")
    history: list[Any] = [{"role": "user", "content": "tools"}, message,
                          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = await oai.chat.completions.create(model=model, messages=history, tools=[tool])
    sent = received(tokenizer, reply.id).messages
    assert sent is not None and sent[1]["tool_calls"] == [CALL]


async def test_output_fields_in_history_do_not_reach_the_template(
        client: httpx.AsyncClient, model: str, tokenizer: FakeTokenizer) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief",
                                        "prompt_cache_breakpoint": {}}], "id": "m0"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "refusal": "I can't help with that.",
         "annotations": [], "audio": None, "function_call": None, "tool_calls": [],
         "parsed": None, "id": "msg_1", "reasoning": None},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": [{"type": "text", "text": "Part one."},
                                          {"type": "refusal", "refusal": "No part two."}],
         "reasoning": "thought"},
        {"role": "user", "content": "q3"},
    ]
    r = await client.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                        "tools": []})
    assert r.status_code == 200, r.text
    assert received(tokenizer, r.json()["id"]).messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "I can't help with that."},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "Part one.\nNo part two.",
         "reasoning_content": "thought"},
        {"role": "user", "content": "q3"}]


async def test_legacy_function_calling_round_trip(oai: openai.AsyncOpenAI, model: str,
                                                  tokenizer: FakeTokenizer) -> None:
    functions: Any = [TOOLS[0]["function"]]
    history: list[Any] = [{"role": "user", "content": "tools"}]
    reply = await oai.chat.completions.create(model=model, messages=history,
                                              functions=functions, function_call="auto")
    [choice] = reply.choices
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call is not None
    assert (choice.message.function_call.name, choice.message.function_call.arguments) == (
        "get_weather", '{"city": "Paris"}')
    history += [choice.message, {"role": "function", "name": "get_weather", "content": "sunny"},
                {"role": "user", "content": "thanks"}]
    reply = await oai.chat.completions.create(model=model, messages=history,
                                              functions=functions)
    sent = received(tokenizer, reply.id).messages
    assert sent is not None
    call_id = sent[1]["tool_calls"][0]["id"]
    assert sent[1]["tool_calls"] == [{**CALL, "id": call_id}]
    assert sent[2] == {"role": "tool", "tool_call_id": call_id, "name": "get_weather",
                       "content": "sunny"}


async def test_legacy_function_call_responses_follow_openai(client: httpx.AsyncClient,
                                                            model: str) -> None:
    body = chat(model, "tools", functions=[TOOLS[0]["function"]])
    r = await client.post("/v1/chat/completions", json=body)
    response = r.json()
    validate_openai("CreateChatCompletionResponse", response)
    validate_ours("ChatCompletion", response)
    assert response["choices"][0]["message"]["function_call"] == CALL["function"]
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = decode_events(await read_sse(s))
    for chunk in chunks:
        validate_openai("CreateChatCompletionStreamResponse", chunk)
        validate_ours("ChatCompletionChunk", chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    pieces = [d["function_call"] for d in deltas if "function_call" in d]
    assert pieces[0]["name"] == "get_weather" and not any("tool_calls" in d for d in deltas)
    assert "".join(p["arguments"] for p in pieces) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"
