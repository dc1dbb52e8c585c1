"""docker-compose.yml keeps the bus closed: NATS, Redis and the internal services publish no
port and share a network with no route out; only the gateway and the dashboards publish."""

from __future__ import annotations

from typing import Any

from tests.test_compose import COMPOSE, SERVICES

PUBLISHED_OK = {"gateway", "jaeger", "grafana", "prometheus"}  # the API and the dashboards


def networks(service: dict[str, Any]) -> set[str]:
    found = service.get("networks", ["default"])
    return set(found if isinstance(found, list) else found.keys())


def test_internal_network_has_no_route_out() -> None:
    assert COMPOSE["networks"]["internal"]["internal"] is True


def test_nats_and_redis_are_reachable_only_inside() -> None:
    for name in ("nats", "redis"):
        assert "ports" not in SERVICES[name], f"{name} publishes a port"
        assert networks(SERVICES[name]) == {"internal"}


def test_only_the_gateway_and_dashboards_publish_ports() -> None:
    published = {name for name, service in SERVICES.items() if service.get("ports")}
    assert "gateway" in published
    assert published <= PUBLISHED_OK, published - PUBLISHED_OK


def test_every_service_on_the_bus_shares_the_internal_network() -> None:
    for name, service in SERVICES.items():
        if "nats" in (service.get("depends_on") or {}) or name in ("nats", "redis"):
            assert "internal" in networks(service), name
