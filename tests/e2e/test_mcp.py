"""MCP tools from mcp.json reach the rendered prompt unless the request opts out."""

from __future__ import annotations

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
