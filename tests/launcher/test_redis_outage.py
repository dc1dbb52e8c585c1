"""An unreachable Redis, with the real gateway (stand-ins for the other services): the launcher
waits saying why ("Redis at ... unreachable: connection refused") on its console, in the state
file and in `flotilla status`, the gateway logs one error line (no traceback flood), and the
suite becomes ready without a restart once Redis answers."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flotilla.services.launcher.nats_server import free_port
from flotilla.services.launcher.state import SuiteState
from flotilla.services.launcher.suite import SuiteOptions, start_suite

ROOT = Path(__file__).resolve().parents[2]


def test_unreachable_redis_is_reported_and_the_suite_recovers_without_restart(
        options: SuiteOptions, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    reason = f"Redis at {url} unreachable: connection refused"
    monkeypatch.setenv("FLOTILLA_REDIS_URL", url)
    del options.commands["gateway"]  # the real gateway
    options.start_timeout_s = 120
    caplog.set_level(logging.INFO, logger="flotilla.services.launcher")
    seen: dict[str, str] = {}
    redis: list[subprocess.Popen[bytes]] = []

    def operator() -> None:
        """Watches like an operator would, then starts Redis."""
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:
            try:
                state = SuiteState.read(options.state_file)
            except (OSError, ValueError, TypeError):
                state = None
            if state is not None and reason in state.reasons:
                seen["state"] = reason
                time.sleep(2.5)  # outlast a few readiness checks and their log lines
                seen["status"] = subprocess.run(
                    [sys.executable, "-m", "flotilla.services.launcher", "status", "--state-file",
                     str(options.state_file)], cwd=ROOT, capture_output=True, text=True,
                    timeout=60).stdout
                redis.append(subprocess.Popen(
                    ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no"], stdout=subprocess.DEVNULL))
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=operator)
    watcher.start()
    try:
        suite = start_suite(options)  # returns once ready: after Redis came up
        try:
            watcher.join()
            state = SuiteState.read(options.state_file)
            assert state.ready and state.restarts["gateway"] == 0
            assert seen.get("state") == reason
            assert seen["status"].startswith(f"{options.state_file}: starting: ")
            assert reason in seen["status"]
            waiting = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
            assert waiting and waiting[0].startswith("waiting: ")
            gateway_log = (Path(state.log_dir) / "gateway.log").read_text()
            assert "Traceback" not in gateway_log
            outage = [line for line in gateway_log.splitlines() if reason in line]
            assert len(outage) == 1  # one line, then a reminder every 30 s at most
            assert "reachable again" in gateway_log
        finally:
            suite.stop()
    finally:
        watcher.join()
        for proc in redis:
            proc.terminate()
            proc.wait(10)
