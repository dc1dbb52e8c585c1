"""docker-compose.yml and docker/Dockerfile checked against the code they run (no Docker engine
needed): every module exists, every FLOTILLA_* variable is a settings field of that service with a
valid value, ports and endpoints agree, every service of the design is there, COPY sources and
mounted files exist, and stop grace periods outlast the drains. The observability services:
tests/test_compose_observability.py."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from flotilla.libs.common.settings import (
    ENV_PREFIX,
    EngineSettings,
    GatewaySettings,
    LauncherSettings,
    TokenizerSettings,
    ToolsSettings,
)
from flotilla.services.tools.config import load_mcp_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DESIGN = {"nats", "redis", "gateway", "tokenizer", "tools", "engine", "otel-collector", "jaeger",
          "prometheus", "grafana"}
SETTINGS = {"flotilla.services.gateway": GatewaySettings,
            "flotilla.services.tokenizer": TokenizerSettings,
            "flotilla.services.engine": EngineSettings, "flotilla.services.tools": ToolsSettings,
            "flotilla.services.launcher": LauncherSettings}
LIGHT_IMAGE_SERVICES = ["gateway", "tokenizer", "tools", "launcher"]  # built without torch


# ---------------------------------------------------------------- parsing helpers


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR}` with an empty environment."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", str(value))


def dockerfile_stages(path: Path) -> dict[str, dict[str, Any]]:
    """name → {"base", "cmd", "copies": [[flags..., src..., dest]]} (CMD inherited from a base
    stage when the stage sets none)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, line
            current = {"base": m.group(1), "cmd": None, "copies": []}
            stages[m.group(2) or f"stage{len(stages)}"] = current
        elif current is not None and op == "CMD":
            current["cmd"] = json.loads(rest)
        elif current is not None and op == "COPY":
            current["copies"].append(rest.split())
    for stage in stages.values():
        base = stage
        while base["cmd"] is None and base["base"] in stages:
            base = stages[base["base"]]
        stage["cmd"] = base["cmd"]
    return stages


def built(name: str) -> bool:
    return "build" in SERVICES[name]


def stages_of(name: str) -> dict[str, dict[str, Any]]:
    build = SERVICES[name]["build"]
    return dockerfile_stages(ROOT / build.get("context", ".") / build["dockerfile"])


def command_of(name: str) -> list[str]:
    svc = SERVICES[name]
    if "command" in svc:
        return list(svc["command"])
    return stages_of(name)[svc["build"]["target"]]["cmd"]


def module_of(argv: list[str]) -> str:
    assert argv[:2] == ["python", "-m"], f"expected `python -m <module>`, got {argv}"
    return argv[2]


def settings_of(name: str) -> type:
    module = module_of(command_of(name))
    return SETTINGS[".".join(module.split(".")[:3])]


def env_of(name: str) -> dict[str, str]:
    env = SERVICES[name].get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(v) for k, v in env.items()}


BUILT = [name for name in SERVICES if built(name)]


# ---------------------------------------------------------------- compose


def test_every_service_of_the_design_is_there() -> None:
    assert DESIGN <= set(SERVICES)


@pytest.mark.parametrize("name", BUILT)
def test_service_runs_an_existing_module(name: str) -> None:
    module = module_of(command_of(name))
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{name} runs `python -m {module}`, which does not exist"
    if spec.submodule_search_locations:  # a package runs its __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{module}.__main__"


@pytest.mark.parametrize("name", BUILT)
def test_flotilla_env_vars_are_settings_fields_with_valid_values(name: str) -> None:
    cls = settings_of(name)
    values = {}
    for key, value in env_of(name).items():
        if not key.startswith(ENV_PREFIX):
            continue
        field = key.removeprefix(ENV_PREFIX).lower()
        assert field in cls.model_fields, f"{name}: {key} is not a field of {cls.__name__}"
        values[field] = value
    cls(**values)  # validates every value as the service will at start-up


def test_flotilla_env_only_on_flotilla_services() -> None:
    for name in set(SERVICES) - set(BUILT):
        assert not any(k.startswith(ENV_PREFIX) for k in env_of(name)), name


def test_gateway_port_and_host_agree_with_its_settings() -> None:
    env = env_of("gateway")
    settings = GatewaySettings(**{k.removeprefix(ENV_PREFIX).lower(): v for k, v in env.items()
                                  if k.startswith(ENV_PREFIX)})
    assert settings.host == "0.0.0.0"  # reachable from outside the container
    published = [str(p).rsplit(":", 1)[-1] for p in SERVICES["gateway"]["ports"]]
    assert published == [str(settings.port)]
    stage = stages_of("gateway")[SERVICES["gateway"]["build"]["target"]]
    assert stage["cmd"] == ["python", "-m", "flotilla.services.gateway"]


@pytest.mark.parametrize("name", BUILT)
def test_urls_point_at_compose_services_on_their_ports(name: str) -> None:
    env = env_of(name)
    nats = urlparse(env["FLOTILLA_NATS_URL"])
    assert nats.hostname == "nats" and nats.port == 4222
    assert "-p" not in SERVICES["nats"].get("command", [])  # nats keeps its default port 4222
    redis = urlparse(env["FLOTILLA_REDIS_URL"])
    assert redis.hostname == "redis" and redis.port == 6379
    if env.get("FLOTILLA_OTEL_EXPORTER") == "otlp":
        otel = urlparse(env["FLOTILLA_OTEL_ENDPOINT"])
        assert otel.hostname in SERVICES
        receivers = collector_config()["receivers"]["otlp"]["protocols"]
        assert receivers["grpc"]["endpoint"].endswith(f":{otel.port}")


def collector_config() -> dict[str, Any]:
    mounts = [v.split(":")[0] for v in SERVICES["otel-collector"]["volumes"]]
    return yaml.safe_load((ROOT / mounts[0]).read_text())


def test_engine_scales_and_reserves_a_gpu() -> None:
    engine = SERVICES["engine"]
    assert "container_name" not in engine and "ports" not in engine
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    cpu = SERVICES["engine-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu and "container_name" not in cpu
    assert env_of("engine-cpu")["FLOTILLA_DEVICE"] == "cpu"
    assert module_of(command_of("engine-cpu")) == "flotilla.services.engine"


def test_no_fixed_container_names() -> None:
    assert not [n for n, s in SERVICES.items() if "container_name" in s]


def test_mounted_files_exist_and_mcp_config_is_valid() -> None:
    for name, svc in SERVICES.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    tools_env = env_of("tools")
    mount = next(v for v in SERVICES["tools"]["volumes"]
                 if v.split(":")[1] == tools_env["FLOTILLA_MCP_CONFIG"])
    for server in load_mcp_config(ROOT / mount.split(":")[0]).values():
        if server.args[:1] == ["-m"]:
            assert importlib.util.find_spec(server.args[1]) is not None, server.args


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_copy_sources_exist() -> None:
    for name in BUILT:
        for stage in stages_of(name).values():
            for copy in stage["copies"]:
                if any(arg.startswith("--from") for arg in copy):
                    continue
                sources = [a for a in copy if not a.startswith("--")][:-1]
                for src in sources:
                    assert (ROOT / src).exists(), f"COPY source {src} is missing"


def test_service_targets_run_their_service() -> None:
    stages = dockerfile_stages(ROOT / "docker" / "Dockerfile")
    for service in ("gateway", "tokenizer", "tools", "engine"):
        assert stages[service]["cmd"] == ["python", "-m", f"flotilla.services.{service}"]
    for name in BUILT:
        assert SERVICES[name]["build"]["target"] in stages


def test_build_context_keeps_the_code() -> None:
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert {"libs", "services", "kernels", "pyproject.toml"} <= kept


@pytest.mark.parametrize("service", LIGHT_IMAGE_SERVICES)
def test_light_images_do_not_need_torch(service: str) -> None:
    """The gateway/tokenizer/tools images are built without torch and triton."""
    module = ("flotilla.services.launcher.cli" if service == "launcher"
              else f"flotilla.services.{service}.service")
    probe = f"import sys, {module}; print('torch' in sys.modules or 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", (
        f"{module} imports torch/triton: build its image from deps-engine in docker/Dockerfile")


# ---------------------------------------------------------------- drain

FLOTILLA_SERVICES = [n for n in BUILT if n != "model"]  # `model` is a one-shot download


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert m, duration
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m.group(2)]


@pytest.mark.parametrize("name", FLOTILLA_SERVICES)
def test_stop_grace_period_outlasts_the_drain(name: str) -> None:
    drain = settings_of(name)(**{k.removeprefix(ENV_PREFIX).lower(): v
                                 for k, v in env_of(name).items()
                                 if k.startswith(ENV_PREFIX)}).drain_timeout_s
    grace = _seconds(SERVICES[name].get("stop_grace_period", "10s"))  # compose's default: 10s
    assert grace >= drain + 5, f"{name}: stop_grace_period {grace}s vs a {drain}s drain"
