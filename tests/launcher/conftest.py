"""Launcher test set-up: suite options that run stand-in services (tests/launcher/standin_service)
with a private NATS on a free port, and quick restarts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flotilla.services.launcher.nats_server import free_port
from flotilla.services.launcher.suite import SERVICES, SuiteOptions
from flotilla.services.launcher.supervisor import RestartPolicy

ROOT = Path(__file__).resolve().parents[2]
STANDINS = {name: [sys.executable, "-m", "tests.launcher.standin_service", name]
            for name in SERVICES}


@pytest.fixture
def options(tmp_path, monkeypatch) -> SuiteOptions:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("FLOTILLA_NATS_URL", raising=False)
    model = tmp_path / "tiny-model.gguf"
    model.write_bytes(b"")
    return SuiteOptions(
        model=str(model), port=0, nats_url=f"nats://127.0.0.1:{free_port()}",  # nothing there
        state_file=tmp_path / "state.json", start_timeout_s=60, stop_grace_s=5,
        restart=RestartPolicy(min_backoff_s=0.1), commands=dict(STANDINS))
