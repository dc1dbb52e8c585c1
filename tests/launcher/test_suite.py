"""The launcher's suite with stand-in services (the real model run is the e2e test's job):
state file, readiness, restart of a killed service and of its private NATS, clean shutdown,
start-up failures that leave other suites alone, the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from flotilla.libs.common.settings import LauncherSettings
from flotilla.services.launcher.cli import build_parser, main
from flotilla.services.launcher.nats_server import NatsServer, free_port, reachable
from flotilla.services.launcher.state import SuiteState
from flotilla.services.launcher.suite import SERVICES, SuiteError, SuiteOptions, start_suite
from tests.launcher.helpers import children, gone, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_suite_starts_restarts_and_stops_cleanly(options) -> None:
    suite = start_suite(options)
    try:
        state = SuiteState.read(options.state_file)
        assert state.ready and state.serving and state.model == "tiny-model"
        assert set(state.pids) == {"nats-server", *SERVICES}
        assert all(not gone(pid) for pid in state.pids.values())
        # nothing answered at the given loopback URL: our own NATS, on exactly that port
        assert state.nats_url == options.nats_url and state.nats_private
        assert reachable(state.nats_url)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", state.gateway_url)
        ready = state.gateway_url.removesuffix("/v1") + "/ready"
        assert httpx.get(ready).status_code == 200

        env = Path(f"/proc/{state.pids['engine']}/environ").read_bytes().split(b"\0")
        assert f"FLOTILLA_MODEL={state.model_path}".encode() in env
        assert f"FLOTILLA_NATS_URL={state.nats_url}".encode() in env
        assert b"FLOTILLA_SERVED_MODEL_NAME=tiny-model" in env

        os.kill(state.pids["engine"], signal.SIGKILL)

        seen_not_ready = []

        def restarted_and_ready() -> bool:
            suite.poll()
            now = SuiteState.read(options.state_file)
            seen_not_ready.append(not now.ready)
            return now.ready and now.pids["engine"] != state.pids["engine"]

        assert wait_until(restarted_and_ready, timeout=20)
        assert any(seen_not_ready)  # `ready` dropped while the engine was down
        now = SuiteState.read(options.state_file)
        assert now.restarts["engine"] == 1 and not gone(now.pids["engine"])
    finally:
        suite.stop()
    final = suite.supervisor.pids() if suite.supervisor else {}
    assert all(gone(pid) for pid in [*final.values(), *state.pids.values()])
    assert not reachable(state.nats_url)
    assert not options.state_file.exists()


def test_a_service_dying_at_start_fails_with_its_log_and_leaves_nothing(options) -> None:
    options.commands["engine"] = [sys.executable, "-c",
                                  "print('cannot load the model', flush=True); raise SystemExit(3)"]
    before = children(os.getpid())
    with pytest.raises(SuiteError, match="(?s)engine exited with code 3.*cannot load the model"):
        start_suite(options)
    assert not options.state_file.exists()
    assert wait_until(lambda: children(os.getpid()) <= before)  # NATS and services all ended


def test_a_missing_model_is_a_clear_error(options) -> None:
    options.model = str(Path(options.state_file).parent / "nope" / "model.gguf")
    with pytest.raises(SuiteError, match="neither an existing path"):
        start_suite(options)


def test_cli_aliases_all_set_the_same_options() -> None:
    parser = build_parser(LauncherSettings())
    for flag in ("--model", "--m", "-m", "--w", "--f"):
        assert parser.parse_args(["up", flag, "x.gguf"]).model == "x.gguf"
    for flag in ("--port", "--p", "-p"):
        assert parser.parse_args(["up", flag, "9001"]).port == 9001
    args = parser.parse_args(["up", "--host", "0.0.0.0", "--mcp-config", "m.json",
                              "--nats-url", "nats://h:1", "--log-level", "DEBUG"])
    assert (args.host, str(args.mcp_config), args.nats_url, args.log_level) == (
        "0.0.0.0", "m.json", "nats://h:1", "DEBUG")


def test_cli_defaults_come_from_launcher_settings(monkeypatch) -> None:
    monkeypatch.setenv("FLOTILLA_PORT", "8123")
    monkeypatch.setenv("FLOTILLA_MODEL", "org/name")
    args = build_parser(LauncherSettings()).parse_args(["up"])
    assert (args.port, args.model) == (8123, "org/name")


def test_cli_help_and_up_failure() -> None:
    out = subprocess.run([sys.executable, "-m", "flotilla.services.launcher", "--help"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "up" in out.stdout and "status" in out.stdout
    out = subprocess.run([sys.executable, "-m", "flotilla.services.launcher", "up", "--m",
                          "/nonexistent/model.gguf", "--p", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "neither an existing path" in out.stderr


def test_cli_status_checks_live_not_the_file(tmp_path, capsys) -> None:
    """A state file that says ready, of a live launcher whose gateway and NATS do not answer:
    status says not ready, with the reasons, and exits 2."""
    path = tmp_path / "flotilla-8000.json"
    port, nats_port = free_port(), free_port()
    SuiteState(launcher_pid=os.getpid(), gateway_url=f"http://127.0.0.1:{port}/v1",
               nats_url=f"nats://127.0.0.1:{nats_port}", model="m", model_path="/m",
               log_dir="/l", nats_private=True, pids={"engine": os.getpid()},
               restarts={"engine": 2}, serving=True, ready=True).write(path)
    assert main(["status", "--state-file", str(path)]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: not ready: gateway not answering at http://127.0.0.1:{port}"
                          "/ready")
    assert f"NATS at nats://127.0.0.1:{nats_port} unreachable" in out
    assert "restarts 2" in out and "private" in out
    assert json.loads(path.read_text())["pids"]["engine"] == os.getpid()


def test_cli_status_of_a_gone_launcher_is_stale(tmp_path, capsys) -> None:
    path = tmp_path / "flotilla-8000.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    SuiteState(launcher_pid=dead.pid, gateway_url="http://127.0.0.1:1/v1",
               nats_url="nats://127.0.0.1:1", model="m", model_path="/m", log_dir="/l",
               ready=True).write(path)
    assert main(["status", "--state-file", str(path)]) == 2
    assert "not running (stale" in capsys.readouterr().out


CLI_WITH_STANDINS = """
import sys
from flotilla.services.launcher import cli, suite

STANDINS = {n: [sys.executable, "-m", "tests.launcher.standin_service", n] for n in suite.SERVICES}
cli.SuiteOptions = lambda **options: suite.SuiteOptions(**options, commands=STANDINS)
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_up_serves_until_signalled_then_stops_everything(tmp_path, sig) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    state_file = tmp_path / "state.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI_WITH_STANDINS, "up", "--p", "0", "--f", str(model),
         "--nats-url", f"nats://127.0.0.1:{free_port()}", "--state-file", str(state_file)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        state = SuiteState.read(state_file)
        assert line.strip() == f"flotilla is serving m at {state.gateway_url}"
        assert state.launcher_pid == proc.pid and state.ready
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert all(gone(pid) for pid in state.pids.values())
    assert not state_file.exists()


def test_the_private_nats_is_supervised_restarted_on_its_port_and_status_follows(
        options, capsys) -> None:
    """SIGKILL of the suite's own nats-server: logged, `ready` false in the state file and in
    `flotilla status` until a new nats-server on the same port is back and every service
    answers again over it; then ready again, one restart counted."""
    options.nats_url = None  # nothing given: private, on a free port
    suite = start_suite(options)
    try:
        state = SuiteState.read(options.state_file)
        assert state.nats_private and reachable(state.nats_url)
        assert main(["status", "--state-file", str(options.state_file)]) == 0
        assert capsys.readouterr().out.startswith(f"{options.state_file}: ready")
        old = state.pids["nats-server"]
        os.kill(old, signal.SIGKILL)
        seen: list[SuiteState] = []

        def back() -> bool:
            suite.poll()
            seen.append(SuiteState.read(options.state_file))
            return seen[-1].ready and seen[-1].pids["nats-server"] != old

        assert wait_until(back, timeout=30, interval=0.1)
        assert any(not s.ready and any("nats-server" in r for r in s.reasons) for s in seen)
        now = seen[-1]
        assert now.nats_url == state.nats_url and reachable(now.nats_url)
        assert now.restarts["nats-server"] == 1 and not gone(now.pids["nats-server"])
        assert {k: v for k, v in now.pids.items() if k != "nats-server"} == {
            k: v for k, v in state.pids.items() if k != "nats-server"}  # services kept running
        assert main(["status", "--state-file", str(options.state_file)]) == 0
    finally:
        suite.stop()
    assert all(gone(pid) for pid in seen[-1].pids.values())
    assert not reachable(state.nats_url)


def test_a_second_launcher_on_the_same_state_file_fails_and_leaves_the_first_alone(
        options, tmp_path) -> None:
    suite = start_suite(options)
    try:
        before = options.state_file.read_text()
        second = SuiteOptions(**{**options.__dict__, "nats_url": None})
        with pytest.raises(SuiteError, match=f"another flotilla is running with "
                           f"{re.escape(str(options.state_file))}.*pid {os.getpid()}"):
            start_suite(second)
        assert options.state_file.read_text() == before
        assert SuiteState.read(options.state_file).ready
    finally:
        suite.stop()


def test_a_busy_port_fails_before_anything_starts(options, tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        options.port = busy.getsockname()[1]
        before = children(os.getpid())
        with pytest.raises(SuiteError, match=f"port {options.port} on 127.0.0.1 is in use"):
            start_suite(options)
        assert children(os.getpid()) <= before  # not even NATS was started
        assert not options.state_file.exists()


def test_an_explicit_answering_nats_is_shared_not_owned(options) -> None:
    with NatsServer() as shared:
        options.nats_url = shared.url
        suite = start_suite(options)
        try:
            state = SuiteState.read(options.state_file)
            assert state.nats_url == shared.url and not state.nats_private
            assert state.pids["nats-server"] is None
        finally:
            suite.stop()
        assert reachable(shared.url)  # not ours to stop
