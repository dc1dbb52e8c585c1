"""MCP tools from mcp.json reach the rendered prompt unless the request opts out, and run on the
server: chat clients that sent no tools get answers (never tool_calls), Responses clients mcp_call
items with the real server's results."""

from __future__ import annotations

import json

from tests.e2e.conftest import MODEL

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def test_mcp_tools_injected_into_prompt(http) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "test_add" in prompt and "test_echo" in prompt


def test_empty_tools_opts_out(http) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": []})
    assert r.status_code == 200, r.text
    assert "test_add" not in r.json()["prompt"]


def test_chat_with_injected_tools_still_answers(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                       max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_chat_without_tools_never_gets_mcp_tool_calls(client) -> None:
    # a named injected MCP tool (small arguments, so the tiny model's constrained call
    # completes); the server runs it and answers: the client sees the answer and the executed
    # calls only
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "test_add"}})
    message = r.choices[0].message
    assert not message.tool_calls
    calls = message.model_extra["mcp_calls"]
    assert calls and calls[0]["name"].startswith("test_")
    assert "output" in calls[0] or "error" in calls[0]


def test_responses_mcp_tool_runs_on_the_server(client) -> None:
    r = client.responses.create(model=MODEL, input="What is 2 + 3?", max_output_tokens=32,
                                tools=[{"type": "mcp", "server_label": "test",
                                        "allowed_tools": ["add"], "require_approval": "never"}],
                                tool_choice="required", temperature=0)
    call = r.output[0]
    assert call.type == "mcp_call" and call.server_label == "test" and call.name == "add"
    if call.error is None:  # the model's arguments were valid: the real server's sum
        args = json.loads(call.arguments)
        assert call.output == str(args["a"] + args["b"])


def test_anthropic_and_responses_clients_get_answers(suite) -> None:
    import anthropic
    from openai import OpenAI

    claude = anthropic.Anthropic(base_url=suite.root_url, api_key="unused", max_retries=0)
    msg = claude.messages.create(model=MODEL, max_tokens=8, messages=[
        {"role": "user", "content": "Say hi"}])
    assert msg.content and msg.usage.output_tokens > 0
    oai = OpenAI(base_url=suite.base_url, api_key="unused", max_retries=0)
    first = oai.responses.create(model=MODEL, input="Say hi", max_output_tokens=8, tools=[])
    second = oai.responses.create(model=MODEL, input="Again", max_output_tokens=8,
                                  previous_response_id=first.id)
    assert second.status in ("completed", "incomplete")
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
