"""The official SDK's documented multi-turn patterns against the real suite (SmolLM2): what a
client appends to its history after `parse()`, after the stream helper, and after a forced tool
call goes back as the next request and is answered; the token endpoints round-trip."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
from pydantic import BaseModel

from tests.e2e.conftest import MODEL

WEATHER: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]}},
                   "required": ["city"]}}}]


class Capital(BaseModel):
    capital: Literal["Paris", "Rome", "Berlin"]


def test_parse_append_next_turn(client) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the capital of France? "
                                                       "Answer in JSON."}]
    completion = client.chat.completions.parse(model=MODEL, messages=messages,
                                               response_format=Capital, temperature=0,
                                               max_tokens=60)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Capital)
    messages.append(completion.choices[0].message)
    messages.append({"role": "user", "content": "And of Italy?"})
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=16)
    assert reply.choices[0].message.content


def test_stream_helper_tool_call_sent_back(client) -> None:
    history: list[Any] = [{"role": "user", "content": "What's the weather in Paris?"}]
    with client.chat.completions.stream(model=MODEL, messages=history, tools=WEATHER,
                                        tool_choice="required", parallel_tool_calls=False,
                                        temperature=0, max_tokens=100) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.tool_calls, message
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    history += [message, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=WEATHER,
                                           temperature=0, max_tokens=24)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_legacy_function_call_round_trip(client) -> None:
    functions: Any = [WEATHER[0]["function"]]
    history: list[Any] = [{"role": "user", "content": "What's the weather in Paris?"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, functions=functions,
                                           function_call={"name": "get_weather"},
                                           temperature=0, max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call
    assert choice.message.function_call.name == "get_weather" and not choice.message.tool_calls
    history += [choice.message, {"role": "function", "name": "get_weather",
                                 "content": "Sunny, 24 C"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, functions=functions,
                                           temperature=0, max_tokens=24)
    assert reply.choices[0].finish_reason in ("stop", "length", "function_call")


def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    text = "The capital of France is Paris."
    for prefix in ("", "/v1"):
        r = http.post(f"{prefix}/tokenize", json={"model": MODEL, "prompt": text,
                                                  "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 5
        assert body["token_strs"][-1] == "."
        r = http.post(f"{prefix}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
        assert r.status_code == 200 and r.json()["prompt"] == text
    chat = http.post("/v1/tokenize", json={"model": MODEL, "tools": [], "messages": [
        {"role": "user", "content": "hi"}]}).json()
    assert "<|im_start|>assistant" in chat["prompt"]
    assert http.post("/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}).json()[
        "prompt"] == chat["prompt"]
    r = http.post("/detokenize", json={"model": MODEL, "tokens": [10**8]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
