"""/v1/messages through the official `anthropic` SDK against a real gateway (fake tokenizer):
every response and stream event parses strictly as the SDK's own types, and the request reaches
the tokenizer as the chat request it stands for."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import anthropic.types as t
import httpx
import pytest

from tests.anthropic.strict import stream_event, strict
from tests.gateway.fakes import FakeTokenizer

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def raw_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The (event name, data) pairs of a streamed /v1/messages, checked to agree."""
    out = []
    async with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                out.append(data)
    return out


async def test_plain_message(claude: anthropic.AsyncAnthropic, client: httpx.AsyncClient,
                             model: str) -> None:
    msg = await claude.messages.create(model=model, max_tokens=32, messages=user("hi"))
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hello world !"
    assert msg.stop_reason == "end_turn" and msg.role == "assistant"
    # the fake reports 7 prompt tokens of which 2 were cached, and 3 generated
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens,
            msg.usage.output_tokens) == (5, 2, 3)
    raw = await client.post("/v1/messages", json={"model": model, "max_tokens": 32,
                                                  "messages": user("hi")})
    strict(t.Message, raw.json())


async def test_a_matched_stop_sequence_is_reported(claude: anthropic.AsyncAnthropic,
                                                  model: str) -> None:
    msg = await claude.messages.create(model=model, max_tokens=32, messages=user("stopseq"),
                                       stop_sequences=["END", "STOP"])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "END")
    async with claude.messages.stream(model=model, max_tokens=32, messages=user("stopseq"),
                                      stop_sequences=["END"]) as s:
        final = await s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    plain = await claude.messages.create(model=model, max_tokens=32, messages=user("hi"))
    assert (plain.stop_reason, plain.stop_sequence) == ("end_turn", None)


async def test_stream_helper_and_events(claude: anthropic.AsyncAnthropic,
                                        client: httpx.AsyncClient, model: str) -> None:
    async with claude.messages.stream(model=model, max_tokens=32, messages=user("hi")) as s:
        texts = [text async for text in s.text_stream]
        final = await s.get_final_message()
    assert "".join(texts) == "Hello world !" == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.input_tokens == 5
    events = await raw_events(client, {"model": model, "max_tokens": 32, "messages": user("hi")})
    for e in events:
        stream_event(e)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["usage"]["output_tokens"] == 3


async def test_tool_use_round_trip(claude: anthropic.AsyncAnthropic,
                                   tokenizer: FakeTokenizer, model: str) -> None:
    msg = await claude.messages.create(model=model, max_tokens=64, tools=[WEATHER],
                                       messages=user("tools"))
    assert msg.stop_reason == "tool_use"
    call = msg.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Paris"}
    sent = tokenizer.requests[-1]
    assert sent.tools is not None and sent.tools[0]["function"]["parameters"] == \
        WEATHER["input_schema"]
    history: list[Any] = [*user("tools"), {"role": "assistant", "content": msg.content},
                          {"role": "user", "content": [
                              {"type": "tool_result", "tool_use_id": call.id,
                               "content": [{"type": "text", "text": "sunny"}]},
                              {"type": "text", "text": "and tomorrow?"}]}]
    second = await claude.messages.create(model=model, max_tokens=64, tools=[WEATHER],
                                          messages=history)
    assert second.content[0].text == "Hello world !"
    messages = tokenizer.requests[-1].messages
    assert messages is not None
    assert messages[1]["tool_calls"][0]["id"] == call.id
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    assert messages[3] == {"role": "user", "content": "and tomorrow?"}


async def test_streamed_tool_use(claude: anthropic.AsyncAnthropic, client: httpx.AsyncClient,
                                 model: str) -> None:
    async with claude.messages.stream(model=model, max_tokens=64, tools=[WEATHER],
                                      messages=user("tools")) as s:
        final = await s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}
    events = await raw_events(client, {"model": model, "max_tokens": 64, "tools": [WEATHER],
                                       "messages": user("tools")})
    for e in events:
        stream_event(e)
    deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(deltas) == '{"city": "Paris"}'


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}})])
async def test_tool_choice_maps_to_chat(claude: anthropic.AsyncAnthropic,
                                        tokenizer: FakeTokenizer, model: str,
                                        choice: Any, expected: Any) -> None:
    await claude.messages.create(model=model, max_tokens=8, tools=[WEATHER], tool_choice=choice,
                                 messages=user("hi"))
    assert tokenizer.requests[-1].tool_choice == expected


async def test_any_tool_choice_without_tools_is_a_400(claude: anthropic.AsyncAnthropic,
                                                      model: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        await claude.messages.create(model=model, max_tokens=8, tool_choice={"type": "any"},
                                     messages=user("hi"))
    assert err.value.body["error"]["type"] == "invalid_request_error"


async def test_thinking(claude: anthropic.AsyncAnthropic, client: httpx.AsyncClient,
                        tokenizer: FakeTokenizer, model: str) -> None:
    thinking = {"type": "enabled", "budget_tokens": 2048}
    msg = await claude.messages.create(model=model, max_tokens=64, thinking=thinking,
                                       messages=user("think"))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Let me think." and msg.content[0].signature
    assert tokenizer.requests[-1].reasoning_effort == "low"
    async with claude.messages.stream(model=model, max_tokens=64, thinking=thinking,
                                      messages=user("think")) as s:
        final = await s.get_final_message()
    assert final.content[0].thinking == "Let me think."
    assert final.content[0].signature == msg.content[0].signature
    events = await raw_events(client, {"model": model, "max_tokens": 64, "thinking": thinking,
                                       "messages": user("think")})
    for e in events:
        stream_event(e)
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta"]
    # the thinking block sent back reaches the template as the assistant's reasoning
    await claude.messages.create(model=model, max_tokens=8, thinking=thinking, messages=[
        *user("think"), {"role": "assistant", "content": msg.content}, *user("hi")])
    sent = tokenizer.requests[-1].messages
    assert sent is not None and sent[1]["reasoning_content"] == "Let me think."


async def test_thinking_disabled_turns_reasoning_off(claude: anthropic.AsyncAnthropic,
                                                     tokenizer: FakeTokenizer,
                                                     model: str) -> None:
    await claude.messages.create(model=model, max_tokens=8, thinking={"type": "disabled"},
                                 messages=user("hi"))
    sent = tokenizer.requests[-1]
    assert sent.reasoning_effort == "none"
    assert sent.chat_template_kwargs == {"enable_thinking": False}


async def test_sampling_fields_reach_the_request(claude: anthropic.AsyncAnthropic,
                                                 tokenizer: FakeTokenizer, model: str) -> None:
    # temperature / top_p / top_k: sent by clients such as Claude Code, no longer in the SDK
    await claude.messages.create(model=model, max_tokens=17, stop_sequences=["END"],
                                 extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},
                                 metadata={"user_id": "u1"},
                                 system=[{"type": "text", "text": "Be brief.",
                                          "cache_control": {"type": "ephemeral"}}],
                                 messages=user("hi"))
    sent = tokenizer.requests[-1]
    assert sent.sampling.max_tokens == 17 and sent.sampling.temperature == 0.5
    assert sent.sampling.top_p == 0.9 and sent.sampling.top_k == 40
    assert sent.stop == ["END"]
    assert sent.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "hi"}]


async def test_output_config(claude: anthropic.AsyncAnthropic, tokenizer: FakeTokenizer,
                             model: str) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    await claude.messages.create(model=model, max_tokens=8, messages=user("hi"),
                                 output_config={"effort": "max",
                                                "format": {"type": "json_schema",
                                                           "schema": schema}})
    sent = tokenizer.requests[-1]
    assert sent.reasoning_effort == "high"
    assert sent.response_format == {"type": "json_schema",
                                    "json_schema": {"name": "output", "schema": schema}}


async def test_assistant_prefill_continues_the_last_message(
        claude: anthropic.AsyncAnthropic, tokenizer: FakeTokenizer, model: str) -> None:
    await claude.messages.create(model=model, max_tokens=8, messages=[
        *user("hi"), {"role": "assistant", "content": "The answer is"}])
    sent = tokenizer.requests[-1]
    assert sent.continue_final_message and not sent.add_generation_prompt


async def test_claude_code_shaped_request(client: httpx.AsyncClient, tokenizer: FakeTokenizer,
                                          model: str) -> None:
    tools = [{**WEATHER, "name": f"tool_{i}", "cache_control": {"type": "ephemeral"}}
             for i in range(24)]
    body = {"model": model, "max_tokens": 32000, "stream": True, "temperature": 1,
            "metadata": {"user_id": "user_abc_account__session_1"},
            "system": [{"type": "text", "text": "You are Claude Code.",
                        "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "Be concise."}],
            "tools": tools,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}
    headers = {"x-api-key": "sk-ant-unused", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    events = []
    async with client.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(stream_event(json.loads(line[6:])))
    assert events[-1].type == "message_stop"
    sent = tokenizer.requests[-1]
    assert sent.tools is not None and len(sent.tools) == 24
    assert sent.messages is not None
    assert sent.messages[0] == {"role": "system",
                                "content": "You are Claude Code.\nBe concise."}


async def test_count_tokens(claude: anthropic.AsyncAnthropic, client: httpx.AsyncClient,
                            model: str) -> None:
    count = await claude.messages.count_tokens(model=model, system="sys", messages=user("hi"))
    # the fake tokenizer's render is "<role>content" per message + "<assistant>", one id a char
    assert count.input_tokens == len("<system>sys<user>hi<assistant>")
    with_tools = await claude.messages.count_tokens(model=model, messages=user("hi"),
                                                    tools=[WEATHER])
    assert with_tools.input_tokens > 0


@pytest.mark.parametrize("body,param_text", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "image"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
])
async def test_bad_requests_answer_in_anthropic_envelope(client: httpx.AsyncClient, model: str,
                                                         body: dict[str, Any],
                                                         param_text: str) -> None:
    r = await client.post("/v1/messages", json={"model": model, **body})
    assert r.status_code == 400
    error = strict(t.ErrorResponse, r.json())
    assert error.error.type == "invalid_request_error"
    assert param_text in error.error.message


async def test_unknown_model_and_refusal(claude: anthropic.AsyncAnthropic, model: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        await claude.messages.create(model="no-such-model", max_tokens=8, messages=user("hi"))
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model=model, max_tokens=8, messages=user("refuse"))
    assert "maximum context length" in refused.value.body["error"]["message"]


async def test_failure_mid_stream_is_an_error_event(client: httpx.AsyncClient,
                                                    model: str) -> None:
    events = await raw_events(client, {"model": model, "max_tokens": 8,
                                       "messages": user("error")})
    assert events[-1]["type"] == "error"
    error = stream_event(events[-1])
    assert error.error.type == "overloaded_error"
