"""docker-compose.yml and docker/Dockerfile checked against the code they run (no Docker engine
needed): every module exists, every FLOTILLA_* variable is a settings field of that service with a
valid value, ports and endpoints agree, every service of the design is there, COPY sources and
mounted files exist, Prometheus scrapes every service where it serves /metrics, and every metric
and label the Grafana dashboard queries is one the services define."""

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

from libs.common.settings import (
    ENV_PREFIX,
    EngineSettings,
    GatewaySettings,
    LauncherSettings,
    TokenizerSettings,
    ToolsSettings,
)
from services.tools.config import load_mcp_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DESIGN = {"nats", "redis", "gateway", "tokenizer", "tools", "engine", "otel-collector", "jaeger",
          "prometheus", "grafana"}
SETTINGS = {"services.gateway": GatewaySettings, "services.tokenizer": TokenizerSettings,
            "services.engine": EngineSettings, "services.tools": ToolsSettings,
            "services.launcher": LauncherSettings}
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
    return SETTINGS[".".join(module.split(".")[:2])]


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
    assert stage["cmd"] == ["python", "-m", "services.gateway"]


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


def test_collector_forwards_traces_to_jaeger() -> None:
    config = collector_config()
    pipeline = config["service"]["pipelines"]["traces"]
    assert set(pipeline["exporters"]) <= set(config["exporters"])
    assert set(pipeline["receivers"]) <= set(config["receivers"])
    endpoints = [e.get("endpoint", "") for e in config["exporters"].values()]
    assert any(ep.split(":")[0] == "jaeger" for ep in endpoints)


def test_engine_scales_and_reserves_a_gpu() -> None:
    engine = SERVICES["engine"]
    assert "container_name" not in engine and "ports" not in engine
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    cpu = SERVICES["engine-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu and "container_name" not in cpu
    assert env_of("engine-cpu")["FLOTILLA_DEVICE"] == "cpu"
    assert module_of(command_of("engine-cpu")) == "services.engine"


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
        assert stages[service]["cmd"] == ["python", "-m", f"services.{service}"]
    for name in BUILT:
        assert SERVICES[name]["build"]["target"] in stages


def test_build_context_keeps_the_code() -> None:
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert {"libs", "services", "kernels", "pyproject.toml"} <= kept


@pytest.mark.parametrize("service", LIGHT_IMAGE_SERVICES)
def test_light_images_do_not_need_torch(service: str) -> None:
    """The gateway/tokenizer/tools images are built without torch and triton."""
    module = "services.launcher.cli" if service == "launcher" else f"services.{service}.service"
    probe = f"import sys, {module}; print('torch' in sys.modules or 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", (
        f"{module} imports torch/triton: build its image from deps-engine in docker/Dockerfile")


# ---------------------------------------------------------------- Prometheus and Grafana

FLOTILLA_SERVICES = [n for n in BUILT if n != "model"]  # `model` is a one-shot download
PROMQL_BUILTIN_LABELS = {"le", "job", "instance"}


def mounted(service: str, target: str) -> Path:
    """The repository path `service` mounts at `target`."""
    for volume in SERVICES[service]["volumes"]:
        source, dest = volume.split(":")[:2]
        if dest == target:
            return ROOT / source
    raise AssertionError(f"{service} mounts nothing at {target}")


def prometheus_config() -> dict[str, Any]:
    return yaml.safe_load(mounted("prometheus", "/etc/prometheus/prometheus.yml").read_text())


def dashboard() -> dict[str, Any]:
    env = env_of("grafana")
    home = Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    folder = mounted("grafana", str(home.parent))
    return json.loads((folder / home.name).read_text())


def defined_series() -> dict[str, set[str]]:
    """Every sample name the services' metrics produce, with its labels: each metric of the
    code observed once, as the services do, and read back through its registry."""
    from libs.common.messages import ErrorInfo, TextFinal, Usage
    from services.engine.metrics import EngineMetrics
    from services.engine.scheduler import SchedulerOutput
    from services.gateway.metrics import GatewayMetrics
    from services.tokenizer.metrics import TokenizerMetrics
    from services.tools.metrics import ToolsMetrics

    gateway = GatewayMetrics()
    timer = gateway.timer("m")
    timer.admitted(0.0)
    timer.data(0)
    timer.data(0)
    timer.final(TextFinal(finish_reason="stop", usage=Usage(prompt_tokens=1,
                                                            completion_tokens=1)))
    gateway.rate_limit_hit("key", "requests")
    gateway.http_requests.labels("/v1/models", "GET", "200").inc()
    gateway.rejections.labels("gateway", "too_large").inc()
    gateway.in_flight.inc()
    engine = EngineMetrics("m", "e", lambda: {}, lambda: {"engine_overloaded": 1})
    engine.observe_step(0.01, SchedulerOutput(queue_waits=[0.1]))
    tokenizer = TokenizerMetrics("m", lambda: 0)
    tokenizer.prepare.observe(0.1)
    tokenizer.refused(ErrorInfo(status=503, type="service_unavailable", message="full"))
    tools = ToolsMetrics()
    tools.calls.labels("server", "ok").inc()
    tools.seconds.labels("server").observe(0.1)
    series: dict[str, set[str]] = {}
    for registry in (gateway.registry, engine.registry, tokenizer.registry, tools.registry):
        assert registry is not None
        for family in registry.collect():
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


def dashboard_queries() -> list[str]:
    return [t["expr"] for panel in dashboard()["panels"] for t in panel["targets"]]


def test_dashboard_queries_only_metrics_and_labels_the_services_define() -> None:
    series = defined_series()
    queries = dashboard_queries()
    assert queries
    for expr in queries:
        metrics = re.findall(r"\b((?:flotilla:|process_)[a-zA-Z0-9_:]+)", expr)
        assert metrics, expr
        for metric in metrics:
            assert metric in series, f"the dashboard queries {metric}, which no service defines"
        labels = set().union(*(series[m] for m in metrics)) | PROMQL_BUILTIN_LABELS
        used = {label for group in re.findall(r"\bby \(([^)]*)\)", expr)
                for label in re.split(r",\s*", group)}
        used |= set(re.findall(r"\{\{(\w+)\}\}", json.dumps(expr)))
        used |= set(re.findall(r"[{,]\s*(\w+)\s*=~?", expr))
        assert used <= labels, f"{expr}: labels {used - labels} are not on {metrics}"
    for panel in dashboard()["panels"]:  # legends name labels of their query too
        for target in panel["targets"]:
            legend = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
            metrics = re.findall(r"\b((?:flotilla:|process_)[a-zA-Z0-9_:]+)", target["expr"])
            labels = set().union(*(series[m] for m in metrics)) | PROMQL_BUILTIN_LABELS
            assert legend <= labels, (panel["title"], legend - labels)


def test_dashboard_shows_what_operators_look_at() -> None:
    titles = " | ".join(p["title"].lower() for p in dashboard()["panels"])
    for view in ("throughput", "time to first token", "inter-token", "end-to-end",
                 "queue depth", "kv-cache", "prefix-cache hit rate", "errors by cause",
                 "per-service cpu"):
        assert view in titles, view
    assert "histogram_quantile(0.99" in " ".join(dashboard_queries())


def test_prometheus_scrapes_every_service_where_it_serves_metrics() -> None:
    scraped: dict[str, int] = {}
    for job in prometheus_config()["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                assert name in SERVICES, f"job {job['job_name']} scrapes unknown service {name}"
                scraped[name] = sd["port"]
    assert set(FLOTILLA_SERVICES) <= set(scraped), set(FLOTILLA_SERVICES) - set(scraped)
    for name in FLOTILLA_SERVICES:
        cls = settings_of(name)
        settings = cls(**{k.removeprefix(ENV_PREFIX).lower(): v for k, v in env_of(name).items()
                          if k.startswith(ENV_PREFIX)})
        if cls is GatewaySettings:  # /metrics on its API port
            assert scraped[name] == settings.port
        else:
            assert settings.metrics_port and scraped[name] == settings.metrics_port, name
            assert settings.metrics_host == "0.0.0.0", name  # reachable from prometheus


def test_grafana_reads_prometheus_and_provisions_the_dashboard() -> None:
    provisioning = mounted("grafana", "/etc/grafana/provisioning")
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    url = urlparse(source["url"])
    assert url.hostname == "prometheus" and url.port == 9090
    assert any(str(p).endswith(":9090") for p in SERVICES["prometheus"]["ports"])
    providers = yaml.safe_load((provisioning / "dashboards" / "flotilla.yml").read_text())
    folder = providers["providers"][0]["options"]["path"]
    assert mounted("grafana", folder).is_dir()
    uids = {t["datasource"]["uid"] for p in dashboard()["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}


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
