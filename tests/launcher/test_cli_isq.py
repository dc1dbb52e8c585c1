"""`flotilla up --isq TYPE` reaches the engine as FLOTILLA_ISQ and its EngineConfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.libs.common.settings import EngineSettings, LauncherSettings
from flotilla.services.engine.factory import engine_config
from flotilla.services.launcher.cli import build_parser
from flotilla.services.launcher.suite import Suite, SuiteOptions


def test_isq_flag_reaches_the_engine_config() -> None:
    args = build_parser(LauncherSettings()).parse_args(["up", "--isq", "q4k"])
    suite = Suite(SuiteOptions(isq=args.isq))
    env = next(s.env for s in suite._specs("nats://x", 1, Path("/m"), "m") if s.name == "engine")
    assert env["FLOTILLA_ISQ"] == "q4k"
    assert engine_config(EngineSettings(isq=env["FLOTILLA_ISQ"]), Path("/m")).isq == "q4k"


def test_unknown_isq_type_is_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser(LauncherSettings()).parse_args(["up", "--isq", "q9z"])
