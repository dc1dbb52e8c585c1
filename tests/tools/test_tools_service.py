"""The tools service against real NATS and a real stdio MCP server (tests/mcp_server.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import HealthReply, HealthRequest
from flotilla.libs.common.settings import ToolsSettings
from flotilla.libs.common.tool_messages import (
    ToolCallReply,
    ToolCallRequest,
    ToolsListReply,
    ToolsListRequest,
)
from flotilla.services.launcher.nats_server import NatsServer
from flotilla.services.tools.config import ToolsConfigError
from flotilla.services.tools.service import ToolsService

MCP_SERVER = str(Path(__file__).resolve().parents[1] / "mcp_server.py")


def _children(pid: int) -> set[int]:
    """Pids whose parent is `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry))
    return found


@pytest.fixture(scope="module")
def nats_url():
    # A private server: the shared one on 4222 may carry other tools services' queue groups.
    with NatsServer() as server:
        yield server.url


@pytest.fixture(scope="module")
async def bus(nats_url):
    b = await Bus.connect(nats_url, "test-tools")
    yield b
    await b.close()


def _write_config(path: Path, servers: dict) -> Path:
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


@pytest.fixture(scope="module")
async def tools(nats_url, tmp_path_factory):
    config = _write_config(tmp_path_factory.mktemp("mcp") / "mcp.json", {
        "test": {"command": sys.executable, "args": [MCP_SERVER, "test"]},
        "missing": {"command": "/nonexistent/flotilla-mcp-server"},
        "crashes": {"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]},
    })
    settings = ToolsSettings(nats_url=nats_url, mcp_config=config, tool_call_timeout_s=3)
    service_bus = await Bus.connect(nats_url, "tools")
    service = ToolsService(settings, service_bus)
    await service.start()
    yield service
    await service.stop()
    await service_bus.close()


async def _list(bus: Bus) -> ToolsListReply:
    return await bus.request(subjects.TOOLS_LIST, ToolsListRequest(), ToolsListReply, timeout=5)


async def _call(bus: Bus, name: str, **arguments) -> ToolCallReply:
    return await bus.request(subjects.TOOLS_CALL, ToolCallRequest(name=name, arguments=arguments),
                             ToolCallReply, timeout=10)


async def test_lists_mcp_tools_as_openai_functions(tools, bus) -> None:
    reply = await _list(bus)
    by_name = {t["function"]["name"]: t for t in reply.tools}
    assert set(by_name) == {"test_add", "test_echo", "test_fail", "test_record", "test_sleep"}
    add = by_name["test_add"]
    assert add["type"] == "function"
    assert add["function"]["description"] == "Add two integers."
    params = add["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["a", "b"]
    assert params["properties"]["a"]["type"] == "integer"


async def test_broken_servers_are_reported_and_others_work(tools, bus) -> None:
    reply = await _list(bus)
    assert set(reply.errors) == {"missing", "crashes"}
    assert "flotilla-mcp-server" in reply.errors["missing"]
    assert (await _call(bus, "test_echo", text="still here")).content == "still here"


async def test_call_routes_to_the_server_tool(tools, bus) -> None:
    reply = await _call(bus, "test_add", a=2, b=40)
    assert reply.ok and reply.error is None
    assert reply.content == "42"


async def test_tool_error_is_a_failed_reply(tools, bus) -> None:
    reply = await _call(bus, "test_fail", message="boom")
    assert not reply.ok and reply.error


async def test_unknown_tool_is_a_failed_reply(tools, bus) -> None:
    reply = await _call(bus, "test_nope")
    assert not reply.ok and "unknown tool" in (reply.error or "")


async def test_slow_tool_times_out(tools, bus) -> None:
    reply = await _call(bus, "test_sleep", seconds=30)
    assert not reply.ok and "timed out" in (reply.error or "")
    assert (await _call(bus, "test_add", a=1, b=1)).content == "2"  # the session survives


async def test_answers_health(tools, bus) -> None:
    reply = await bus.request(subjects.health("tools"), HealthRequest(), HealthReply, timeout=5)
    assert reply.ok and reply.detail["tools"] == 5 and reply.detail["servers"] == ["test"]


async def test_no_config_serves_an_empty_list(nats_url) -> None:
    service_bus = await Bus.connect(nats_url, "tools-empty")
    service = ToolsService(ToolsSettings(nats_url=nats_url, mcp_config=None), service_bus)
    try:
        await service.start()
        assert await service._list(ToolsListRequest()) == ToolsListReply(tools=[], errors={})
    finally:
        await service.stop()
        await service_bus.close()


async def test_stop_ends_the_mcp_server_processes(nats_url, tmp_path) -> None:
    config = _write_config(tmp_path / "mcp.json", {
        "one": {"command": sys.executable, "args": [MCP_SERVER, "one"]}})
    before = _children(os.getpid())
    service_bus = await Bus.connect(nats_url, "tools-stop")
    service = ToolsService(ToolsSettings(nats_url=nats_url, mcp_config=config), service_bus)
    await service.start()
    started = _children(os.getpid()) - before
    assert len(started) == 1
    await service.stop()
    await service_bus.close()
    assert not (_children(os.getpid()) & started)


@pytest.mark.parametrize("content, problem", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ('{"servers": {}}', "mcpServers"),
    ('{"mcpServers": {"x": {"args": []}}}', "command"),
])
def test_bad_config_is_a_clear_startup_error(tmp_path, content, problem) -> None:
    path = tmp_path / "mcp.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ToolsConfigError, match=problem) as err:
        ToolsService(ToolsSettings(mcp_config=path), bus=None)  # type: ignore[arg-type]
    assert str(path) in str(err.value)
