"""`flotilla up --cpu-moe / --n-cpu-moe N / --num-experts-offload-per-rank N /
--moe-offload-mode M` reach the engine's environment, its settings and its EngineConfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.libs.common.settings import EngineSettings, LauncherSettings
from flotilla.services.engine.factory import engine_config
from flotilla.services.engine.layers.moe_offload import ExpertOffload
from flotilla.services.launcher.cli import build_parser, moe_offload_env
from flotilla.services.launcher.suite import Suite, SuiteOptions


def _engine_env(argv: list[str]) -> dict[str, str]:
    args = build_parser(LauncherSettings()).parse_args(["up", *argv])
    suite = Suite(SuiteOptions(moe_offload=moe_offload_env(args)))
    return next(s.env for s in suite._specs("nats://x", 1, Path("/m"), "m") if s.name == "engine")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ExpertOffload()),
        (["--cpu-moe"], ExpertOffload(all_layers=True)),
        (["--n-cpu-moe", "3"], ExpertOffload(first_layers=3)),
        (
            ["--num-experts-offload-per-rank", "15", "--moe-offload-mode", "stream"],
            ExpertOffload(experts_per_rank=15, mode="stream"),
        ),
    ],
)
def test_offload_flags_reach_the_engine_config(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], expected: ExpertOffload
) -> None:
    env = _engine_env(argv)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = engine_config(EngineSettings(), Path("/m"))
    assert config.expert_offload == expected
    assert config.enforce_eager == expected.active  # the routing goes to the host each step


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        EngineSettings(n_cpu_moe=-1)
