"""One suite start-up for all end-to-end tests: `flotilla up` as a user runs it.

The launcher is started as a subprocess with the embedded default model (SmolLM2-135M-Instruct),
its own private NATS (the default: no --nats-url, FLOTILLA_NATS_URL removed from its
environment; tests find the URL in the state file), the test Redis (tests/endpoints.py) for
shared state, an mcp.json pointing at the test MCP server, and the chat web UI on (`--ui`). A
private NATS is what lets the chaos test kill it, and keeps this suite's subjects apart from
anything else on the host. The fixture is package-scoped so the suite is gone before other test
packages run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from flotilla.libs.common.nats_auth import NatsSecurity
from tests.endpoints import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 900


@dataclass
class SuiteHandle:
    proc: subprocess.Popen[str]
    state_file: Path
    base_url: str  # http://host:port/v1

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    @property
    def nats_url(self) -> str:
        return str(self.state()["nats_url"])

    @property
    def nats_security(self) -> NatsSecurity | None:
        """The private NATS's generated token (the launcher's 0600 file named in the state)."""
        path = self.state().get("nats_token_file")
        return NatsSecurity(token=SecretStr(Path(path).read_text())) if path else None

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def wait_ready(self, timeout: float, changed_pid: tuple[str, int] | None = None) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = self.state()
            except (OSError, ValueError):
                st = {}
            pid_ok = changed_pid is None or st.get("pids", {}).get(changed_pid[0]) not in (
                None, changed_pid[1])
            if st.get("ready") and pid_ok:
                return st
            time.sleep(0.2)
        raise TimeoutError(f"suite not ready within {timeout}s: {self.state()}")


@pytest.fixture(scope="package")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SuiteHandle]:
    tmp = tmp_path_factory.mktemp("suite")
    mcp = tmp / "mcp.json"
    mcp.write_text(json.dumps({"mcpServers": {"test": {
        "command": sys.executable, "args": [str(ROOT / "tests" / "mcp_server.py")], "env": {}}}}))
    state_file = tmp / "state.json"
    env = dict(os.environ, FLOTILLA_REDIS_URL=REDIS_URL, PYTHONUNBUFFERED="1",
               FLOTILLA_RUN_DIR=str(tmp))
    env.pop("FLOTILLA_NATS_URL", None)  # a private NATS
    # The console script a user runs (installed by `pip install -e .`); the module otherwise.
    exe = shutil.which("flotilla")
    launcher = [exe] if exe else [sys.executable, "-m", "flotilla.services.launcher"]
    cmd = [*launcher, "up", "--port", "0", "--state-file", str(state_file),
           "--mcp-config", str(mcp), "--ui"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = None
    lines: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "flotilla is serving" in line:
            url = line.rsplit(" at ", 1)[1].strip()
            break
    if url is None:
        proc.kill()
        pytest.fail("the suite did not start:\n" + "".join(lines[-40:]))
    handle = SuiteHandle(proc, state_file, url)
    handle.wait_ready(60)
    yield handle
    pids = [p for p in handle.state().get("pids", {}).values() if p]
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Shutdown leaves no orphans: every child the launcher started is gone.
    time.sleep(0.5)
    alive = [p for p in pids if _alive(p)]
    assert not alive, f"processes left running after SIGTERM: {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of an exited child counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def client(suite: SuiteHandle):
    from openai import OpenAI

    return OpenAI(base_url=suite.base_url, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture
def http(suite: SuiteHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=suite.root_url, timeout=120) as c:
        yield c


MODEL = "SmolLM2-135M-Instruct"
