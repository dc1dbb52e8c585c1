"""docker-compose.yml's observability services checked against the code (no Docker engine
needed): the collector forwards traces to Jaeger, Prometheus scrapes every service where it
serves /metrics, and every metric and label the Grafana dashboard queries is one the services
define. Parsing helpers: tests/test_compose.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from flotilla.libs.common.settings import ENV_PREFIX, GatewaySettings
from tests.test_compose import (
    FLOTILLA_SERVICES,
    ROOT,
    SERVICES,
    collector_config,
    env_of,
    settings_of,
)


def test_collector_forwards_traces_to_jaeger() -> None:
    config = collector_config()
    pipeline = config["service"]["pipelines"]["traces"]
    assert set(pipeline["exporters"]) <= set(config["exporters"])
    assert set(pipeline["receivers"]) <= set(config["receivers"])
    endpoints = [e.get("endpoint", "") for e in config["exporters"].values()]
    assert any(ep.split(":")[0] == "jaeger" for ep in endpoints)


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
    from flotilla.libs.common.messages import ErrorInfo, TextFinal, Usage
    from flotilla.services.engine.metrics import EngineMetrics
    from flotilla.services.engine.scheduler import SchedulerOutput
    from flotilla.services.gateway.metrics import GatewayMetrics
    from flotilla.services.tokenizer.metrics import TokenizerMetrics
    from flotilla.services.tools.metrics import ToolsMetrics

    gateway = GatewayMetrics()
    timer = gateway.timer("m")
    timer.admitted(0.0)
    timer.data(0)
    timer.data(0)
    timer.final(TextFinal(finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1)))
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
        used = {
            label
            for group in re.findall(r"\bby \(([^)]*)\)", expr)
            for label in re.split(r",\s*", group)
        }
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
    for view in (
        "throughput",
        "time to first token",
        "inter-token",
        "end-to-end",
        "queue depth",
        "kv-cache",
        "prefix-cache hit rate",
        "errors by cause",
        "per-service cpu",
    ):
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
        settings = cls(
            **{
                k.removeprefix(ENV_PREFIX).lower(): v
                for k, v in env_of(name).items()
                if k.startswith(ENV_PREFIX)
            }
        )
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
