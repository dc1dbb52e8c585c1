"""MCP tool injection: a chat request without `tools` offers the tools service's tools; `tools: []`
opts out; a request's own tools are kept; no tools service means no tools, not an error."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import Announcement, TextRequest
from flotilla.libs.common.tool_messages import ToolsListReply, ToolsListRequest
from flotilla.services.gateway.tools import ToolsCache, tools_for
from tests.gateway.conftest import chat
from tests.gateway.fakes import FakeTokenizer, FakeTools

OWN_TOOL = {"type": "function", "function": {"name": "own_tool", "parameters": {"type": "object"}}}


@pytest.fixture
async def mcp(bus: Bus) -> AsyncIterator[FakeTools]:
    name = f"fake_server_{uuid.uuid4().hex[:6]}"
    tools = FakeTools(bus, [{"type": "function", "function": {
        "name": name, "description": "a fake MCP tool", "parameters": {"type": "object"}}}])
    await tools.start()
    yield tools
    await tools.stop()


def _sent(tokenizer: FakeTokenizer, response: httpx.Response) -> TextRequest:
    rid = response.json()["id"].removeprefix("chatcmpl-")
    return next(q for q in tokenizer.requests if q.request_id == f"{rid}-0")


async def test_request_without_tools_gets_the_mcp_tools(client: httpx.AsyncClient, model: str,
                                                        tokenizer: FakeTokenizer,
                                                        mcp: FakeTools) -> None:
    r = await client.post("/v1/chat/completions", json=chat(model, tool_choice="auto"))
    assert r.status_code == 200, r.text
    sent = _sent(tokenizer, r)
    assert sent.tools == mcp.tools and sent.tool_choice == "auto"
    r = await client.post("/v1/chat/completions", json=chat(model, tools=None))
    assert _sent(tokenizer, r).tools == mcp.tools  # null is the same as absent


async def test_empty_tools_opt_out(client: httpx.AsyncClient, model: str,
                                   tokenizer: FakeTokenizer, mcp: FakeTools) -> None:
    calls = mcp.calls
    r = await client.post("/v1/chat/completions", json=chat(model, tools=[]))
    assert r.status_code == 200
    assert _sent(tokenizer, r).tools is None
    assert mcp.calls == calls  # the tools service was not even asked


async def test_own_tools_are_kept(client: httpx.AsyncClient, model: str,
                                  tokenizer: FakeTokenizer, mcp: FakeTools) -> None:
    r = await client.post("/v1/chat/completions", json=chat(model, tools=[OWN_TOOL]))
    assert _sent(tokenizer, r).tools == [OWN_TOOL]


async def test_no_or_slow_tools_service_means_no_tools(bus: Bus,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A subject of our own, so another suite's tools service cannot answer.
    subject = f"test.tools.{uuid.uuid4().hex}"
    monkeypatch.setattr(subjects, "TOOLS_LIST", subject)
    assert await tools_for({"messages": []}, bus, timeout_s=0.5) is None  # nobody serves it

    async def slow(_: ToolsListRequest) -> ToolsListReply:
        await asyncio.sleep(1.0)
        return ToolsListReply(tools=[OWN_TOOL])

    sub = await bus.serve(subject, ToolsListRequest, slow)
    try:
        started = time.monotonic()
        assert await tools_for({"messages": []}, bus, timeout_s=0.2) is None
        assert time.monotonic() - started < 0.9
    finally:
        await sub.unsubscribe()


async def test_tool_list_is_fetched_once_per_ttl_and_dropped_when_a_tools_service_starts(
        bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    subject = f"test.tools.{uuid.uuid4().hex}"
    monkeypatch.setattr(subjects, "TOOLS_LIST", subject)
    calls: list[int] = []
    offered = [OWN_TOOL]

    async def serve(_: ToolsListRequest) -> ToolsListReply:
        calls.append(1)
        await asyncio.sleep(0.05)
        return ToolsListReply(tools=list(offered))

    sub = await bus.serve(subject, ToolsListRequest, serve)
    cache = ToolsCache(bus, timeout_s=2.0, ttl_s=60.0)
    await cache.start()
    try:
        burst = await asyncio.gather(*(cache.tools_for({"messages": []}) for _ in range(16)))
        assert burst == [[OWN_TOOL]] * 16 and len(calls) == 1  # one round trip for the burst
        assert await cache.tools_for({"messages": []}) == [OWN_TOOL] and len(calls) == 1
        assert await cache.tools_for({"messages": [], "tools": []}) is None
        offered.append({"type": "function", "function": {"name": "new_tool"}})
        await bus.publish(subjects.DISCOVERY_ANNOUNCE, Announcement(
            service="tools", instance=f"tools-{uuid.uuid4().hex[:8]}"))
        deadline = time.monotonic() + 2
        while len(await cache.tools()) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await cache.tools() == offered and len(calls) == 2
    finally:
        await cache.stop()
        await sub.unsubscribe()
