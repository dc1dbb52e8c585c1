"""`flotilla up --fp8-kvcache` reaches the engine as FLOTILLA_KV_CACHE_DTYPE=fp8 and its
EngineConfig; without the flag the engine keeps its default cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.libs.common.settings import EngineSettings, LauncherSettings
from flotilla.services.engine.factory import engine_config
from flotilla.services.launcher.cli import build_parser
from flotilla.services.launcher.suite import Suite, SuiteOptions


def _engine_env(argv: list[str]) -> dict[str, str]:
    args = build_parser(LauncherSettings()).parse_args(["up", *argv])
    suite = Suite(SuiteOptions(fp8_kvcache=args.fp8_kvcache))
    return next(s.env for s in suite._specs("nats://x", 1, Path("/m"), "m") if s.name == "engine")


def test_fp8_kvcache_flag_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _engine_env(["--fp8-kvcache"])
    assert env["FLOTILLA_KV_CACHE_DTYPE"] == "fp8"
    monkeypatch.setenv("FLOTILLA_KV_CACHE_DTYPE", env["FLOTILLA_KV_CACHE_DTYPE"])
    assert engine_config(EngineSettings(), Path("/m")).kv_cache_dtype == "fp8"


def test_default_cache_without_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "FLOTILLA_KV_CACHE_DTYPE" not in _engine_env([])
    monkeypatch.delenv("FLOTILLA_KV_CACHE_DTYPE", raising=False)
    assert engine_config(EngineSettings(), Path("/m")).kv_cache_dtype == "auto"
