"""`flotilla up --ui` / `--ui-server` / FLOTILLA_UI=1 turn the gateway's chat UI on."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.libs.common.settings import GatewaySettings, LauncherSettings
from flotilla.services.launcher.cli import build_parser
from flotilla.services.launcher.suite import Suite, SuiteOptions


def gateway_env(ui: bool) -> dict[str, str]:
    suite = Suite(SuiteOptions(ui=ui))
    return next(s.env for s in suite._specs("nats://x", 1, Path("/m"), "m") if s.name == "gateway")


@pytest.mark.parametrize("flag", ["--ui", "--ui-server"])
def test_flag_reaches_the_gateway_settings(flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_UI", raising=False)
    args = build_parser(LauncherSettings()).parse_args(["up", flag])
    assert args.ui is True
    env = gateway_env(args.ui)
    assert env["FLOTILLA_UI"] == "1"
    monkeypatch.setenv("FLOTILLA_UI", env["FLOTILLA_UI"])
    assert GatewaySettings().ui is True


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_UI", raising=False)
    assert build_parser(LauncherSettings()).parse_args(["up"]).ui is False
    assert "FLOTILLA_UI" not in gateway_env(False)


def test_environment_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_UI", "true")
    assert build_parser(LauncherSettings()).parse_args(["up"]).ui is True
