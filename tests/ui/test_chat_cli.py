"""`flotilla chat` against a real gateway (fake tokenizers), driven through a pipe: streamed
answers, reasoning, tool calls, errors, history within a chat, /new, /exit, the options sent."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


async def chat(gateway: Any, lines: list[str], *args: str) -> tuple[int, str]:
    """Runs `python -m flotilla.services.chat` with `lines` on stdin; returns its exit code and
    output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "NO_COLOR": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flotilla.services.chat", "--url", gateway.url + "/v1", *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=ROOT, env=env)
    out, _ = await asyncio.wait_for(proc.communicate("".join(f"{x}\n" for x in lines).encode()),
                                    45)
    return proc.returncode or 0, out.decode()


async def test_streams_answers_and_keeps_the_history(gateway, models) -> None:
    fake = models[0]
    before = len(fake.requests)
    code, out = await chat(gateway, ["hello", "think", "/new", "tools", "/exit", "never sent"],
                           "--model", fake.model, "--system", "Be brief.")
    assert code == 0, out
    assert "Hello world !" in out
    assert "First, consider the question. Then answer it." in out  # reasoning, shown
    assert "The answer is 42." in out
    assert '→ tool call get_weather({"city": "Paris"})' in out
    assert "TTFT" in out and "tok/s" in out
    sent = fake.requests[before:]
    assert [[m["content"] for m in r.messages] for r in sent] == [
        ["Be brief.", "hello"],
        ["Be brief.", "hello", "Hello world !", "think"],  # the history of this chat
        ["Be brief.", "tools"],  # after /new
    ]


async def test_sampling_options_are_sent(gateway, models) -> None:
    fake = models[1]
    code, out = await chat(gateway, ["hello"], "--model", fake.model, "--temperature", "0.2",
                           "--top-p", "0.5", "--max-tokens", "33", "--no-thinking")
    assert code == 0 and "Hello world !" in out, out  # end of input quits cleanly
    req = fake.requests[-1]
    assert req.sampling.temperature == pytest.approx(0.2)
    assert req.sampling.top_p == pytest.approx(0.5)
    assert req.sampling.max_tokens == 33
    assert req.chat_template_kwargs == {"enable_thinking": False}


async def test_live_markdown_and_hidden_reasoning(gateway, models) -> None:
    code, out = await chat(gateway, ["markdown", "think"], "--model", models[0].model, "--live",
                           "--hide-reasoning")
    assert code == 0, out
    assert "Greeting" in out and "## Greeting" not in out  # rendered, not raw Markdown
    assert 'return f"Hello, {name}!"' in out
    assert "consider the question" not in out and "The answer is 42." in out


async def test_errors_are_shown_and_the_chat_goes_on(gateway, models) -> None:
    code, out = await chat(gateway, ["refuse", "error", "hello"], "--model", models[0].model)
    assert code == 0, out
    assert ("error: 400 invalid_request_error (param messages): This model's maximum context "
            "length is 4096 tokens.") in out
    assert "the engine went away" in out
    assert "Hello world !" in out


async def test_default_model_and_unreachable_gateway(gateway, models) -> None:
    code, out = await chat(gateway, ["/exit"])
    assert code == 0 and "chatting with " in out, out  # the first listed model
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flotilla.services.chat", "--url", "http://127.0.0.1:9/v1",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env=env)
    out_bytes, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1 and "cannot reach the gateway" in out_bytes.decode()
