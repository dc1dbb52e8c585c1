"""The agent loop of /v1/responses with `mcp` tools, against the real tools service running the
test MCP server (tests/mcp_server.py) and a scripted tokenizer: the model's MCP calls run on the
server, their real results reach the next turn, and every step is streamed as items."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import TextDelta, TextFinal, TextRequest, ToolCallDelta, Usage
from flotilla.libs.common.settings import ToolsSettings
from flotilla.services.gateway.service import GatewayService
from flotilla.services.tools.service import ToolsService
from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_openai
from tests.responses.official import validate_event

ROOT = Path(__file__).resolve().parents[2]
CALLS = {"add": ("test_add", {"a": 2, "b": 40}), "sleep": ("test_sleep", {"seconds": 5}),
         "record": ("test_record", {"text": "hello"}), "other": ("other_record", {"text": "x"}),
         "loop": ("test_echo", {"text": "again"}), "bad": ("test_add", '{"a": 2,')}


class ScriptedTokenizer(FakeTokenizer):
    """Calls the tool its prompt names (if offered and tools are not off), answers with the
    tool's result once it has one."""

    async def _stream(self, req: TextRequest, scenario: str, writer: Any) -> None:
        usage = Usage(prompt_tokens=10, completion_tokens=2)
        last = (req.messages or [{}])[-1]
        offered = {t["function"]["name"] for t in req.tools or []}
        first = [m["content"] for m in req.messages or [] if m["role"] == "user"][-1]
        call = CALLS.get(first)
        if req.tool_choice == "none" or call is None or (
                last["role"] == "tool" and first != "loop"):
            text = f"The tool said: {last['content']}" if last["role"] == "tool" else "done"
            await writer.data(TextDelta(text=text))
            await writer.final(TextFinal(finish_reason="stop", usage=usage))
            return
        name, args = call
        if first != "other" and name not in offered:
            raise AssertionError(f"{name} was not offered: {offered}")
        await writer.data(TextDelta(tool_calls=[ToolCallDelta(
            index=0, id=f"call_{uuid.uuid4().hex[:6]}", name=name,
            arguments=args if isinstance(args, str) else json.dumps(args))]))
        await writer.final(TextFinal(finish_reason="tool_calls", usage=usage))


@pytest.fixture(scope="module")
async def scripted(bus: Bus, gateway: GatewayService) -> AsyncIterator[ScriptedTokenizer]:
    fake = ScriptedTokenizer(bus, f"test-mcp-{uuid.uuid4().hex[:8]}")
    await fake.start()
    # the first request must not race the gateway's discovery of this model (a 404 under load)
    for _ in range(200):
        if await gateway.state.registry.get(fake.model) is not None:
            break
        await asyncio.sleep(0.05)
    yield fake
    await fake.stop()


@pytest.fixture(scope="module")
def record_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcp") / "record.txt"


@pytest.fixture(scope="module")
async def tools(bus: Bus, record_file: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ToolsService]:
    server = {"command": sys.executable, "args": [str(ROOT / "tests" / "mcp_server.py")],
              "env": {"MCP_TEST_RECORD": str(record_file)}}
    config = tmp_path_factory.mktemp("mcpconf") / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"test": server, "other": server}}))
    from tests.endpoints import NATS_URL

    service = ToolsService(ToolsSettings(nats_url=NATS_URL, mcp_config=config,
                                         tool_call_timeout_s=1.0, request_timeout_s=30.0), bus)
    await service.start()
    yield service
    await service.stop()


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = await client.post("/v1/responses", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    for e in events:
        validate_event(e)
    return events


def _mcp(**extra: Any) -> list[dict[str, Any]]:
    return [{"type": "mcp", "server_label": "test", "require_approval": "never", **extra}]


async def test_mcp_call_runs_on_the_server(client: httpx.AsyncClient, tools: ToolsService,
                                           gateway: GatewayService,
                                           scripted: ScriptedTokenizer) -> None:
    body = {"model": scripted.model, "input": "add", "tools": _mcp()}
    r = await client.post("/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    response = r.json()
    validate_openai("Response", response)
    call, answer = response["output"]
    assert call["type"] == "mcp_call" and call["server_label"] == "test"
    assert call["name"] == "add" and call["output"] == "42" and call["status"] == "completed"
    assert answer["content"][0]["text"] == "The tool said: 42"
    assert response["usage"]["input_tokens"] == 20  # two turns
    # the second turn saw the call and its real result
    messages = scripted.requests[-1].messages
    assert messages is not None and messages[-1] == {
        "role": "tool", "tool_call_id": call["id"], "content": "42"}
    events = await _stream(client, body)
    kinds = [e["type"] for e in events]
    for kind in ("response.mcp_call_arguments.delta", "response.mcp_call_arguments.done",
                 "response.mcp_call.in_progress", "response.mcp_call.completed"):
        assert kind in kinds
    assert kinds[-1] == "response.completed"


async def test_side_effect_and_chain(client: httpx.AsyncClient, tools: ToolsService,
                                     gateway: GatewayService, scripted: ScriptedTokenizer,
                                     record_file: Path) -> None:
    r = await client.post("/v1/responses", json={"model": scripted.model, "input": "record",
                                                 "tools": _mcp(allowed_tools=["record"])})
    assert r.status_code == 200, r.text
    assert record_file.read_text().splitlines()[-1] == "hello"
    first = r.json()
    follow = await client.post("/v1/responses", json={
        "model": scripted.model, "input": "thanks", "previous_response_id": first["id"]})
    assert follow.status_code == 200
    messages = scripted.requests[-1].messages
    assert messages is not None
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]


async def test_a_hanging_tool_times_out_into_an_error_result(
        client: httpx.AsyncClient, tools: ToolsService, gateway: GatewayService,
        scripted: ScriptedTokenizer) -> None:
    r = await client.post("/v1/responses", json={"model": scripted.model, "input": "sleep",
                                                 "tools": _mcp()}, timeout=30)
    assert r.status_code == 200, r.text
    call, answer = r.json()["output"]
    assert call["status"] == "failed" and "timed out" in call["error"]
    assert answer["content"][0]["text"].startswith("The tool said: Error:")


async def test_a_server_not_on_the_request_is_never_called(
        client: httpx.AsyncClient, tools: ToolsService, gateway: GatewayService,
        scripted: ScriptedTokenizer, record_file: Path) -> None:
    before = record_file.read_text() if record_file.exists() else ""
    r = await client.post("/v1/responses", json={"model": scripted.model, "input": "other",
                                                  "tools": _mcp()})
    assert r.status_code == 200, r.text
    (item,) = r.json()["output"]
    assert item["type"] == "function_call"  # not an MCP tool of this request: the client's
    assert (record_file.read_text() if record_file.exists() else "") == before
    result = await tools.registry.call("other_record", {"text": "x"}, servers=["test"])
    assert not result.ok and "may not use" in (result.error or "")
    assert (record_file.read_text() if record_file.exists() else "") == before


async def test_the_loop_is_bounded(client: httpx.AsyncClient, tools: ToolsService,
                                   gateway: GatewayService,
                                   scripted: ScriptedTokenizer) -> None:
    r = await client.post("/v1/responses", json={"model": scripted.model, "input": "loop",
                                                 "tools": _mcp()}, timeout=60)
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    calls = [o for o in output if o["type"] == "mcp_call"]
    assert len(calls) == gateway.settings.mcp_max_iterations
    assert output[-1]["type"] == "message"  # the last turn ran without tools: an answer
    assert scripted.requests[-1].tool_choice == "none"


async def test_unknown_server_label(client: httpx.AsyncClient, tools: ToolsService,
                                    gateway: GatewayService, scripted: ScriptedTokenizer) -> None:
    await asyncio.sleep(0)
    r = await client.post("/v1/responses", json={"model": scripted.model, "input": "add",
                                                 "tools": [{"type": "mcp",
                                                            "server_label": "nope"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].server_label"


async def test_chat_without_tools_gets_the_answer_not_tool_calls(
        client: httpx.AsyncClient, tools: ToolsService, gateway: GatewayService,
        scripted: ScriptedTokenizer) -> None:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0,
                           timeout=30) as oai:
        r = await oai.chat.completions.create(
            model=scripted.model, messages=[{"role": "user", "content": "add"}])
        message = r.choices[0].message
        assert message.content == "The tool said: 42" and not message.tool_calls
        assert r.choices[0].finish_reason == "stop"
        assert message.model_extra is not None
        assert message.model_extra["mcp_calls"] == [
            {"name": "test_add", "arguments": '{"a": 2, "b": 40}', "output": "42"}]
        validate_openai("CreateChatCompletionResponse", r.model_dump(exclude_unset=True))
        stream = await oai.chat.completions.create(
            model=scripted.model, messages=[{"role": "user", "content": "add"}], stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The tool said: 42"
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].delta.model_extra["mcp_calls"][0]["output"] == "42"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 20
    for c in chunks:
        validate_openai("CreateChatCompletionStreamResponse", c.model_dump(exclude_unset=True))


async def test_a_call_with_broken_arguments_ends_the_loop_with_its_error(
        client: httpx.AsyncClient, tools: ToolsService, scripted: ScriptedTokenizer) -> None:
    r = await client.post("/v1/chat/completions", json={
        "model": scripted.model, "messages": [{"role": "user", "content": "bad"}]}, timeout=30)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert not message.get("tool_calls") and r.json()["choices"][0]["finish_reason"] == "stop"
    assert message["mcp_calls"] == [{"name": "test_add", "arguments": '{"a": 2,',
                                     "error": "the arguments are not a JSON object"}]
