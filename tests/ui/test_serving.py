"""How the gateway serves the chat UI (services/gateway/ui.py): only with the setting on, at /
and /ui/<file>, with the Content-Security-Policy and caching headers, nothing else from disk."""

from __future__ import annotations

import gzip

import httpx
import pytest

from flotilla.libs.common.store import make_store
from flotilla.services.gateway.app import create_app
from flotilla.services.gateway.ui import STATIC_DIR
from tests.gateway.conftest import gateway_settings


def directives(csp: str) -> dict[str, list[str]]:
    parts = [p.split() for p in csp.split(";") if p.strip()]
    return {p[0]: p[1:] for p in parts}


@pytest.fixture
async def http(gateway):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
        yield client


async def test_page_is_served_with_a_strict_csp(http: httpx.AsyncClient) -> None:
    r = await http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.content == (STATIC_DIR / "index.html").read_bytes()
    csp = directives(r.headers["content-security-policy"])
    assert csp["default-src"] == ["'none'"]
    for name in ("script-src", "style-src", "connect-src"):
        assert csp[name] == ["'self'"], (name, csp[name])  # no inline, no eval, no other host
    assert csp["frame-ancestors"] == ["'none'"] and csp["base-uri"] == ["'none'"]
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"


async def test_assets_revalidate_and_compress(http: httpx.AsyncClient) -> None:
    r = await http.get("/ui/app.js", headers={"accept-encoding": "gzip"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
    assert r.headers["content-encoding"] == "gzip"  # httpx has already decoded it
    assert r.content == (STATIC_DIR / "app.js").read_bytes()
    assert r.headers["cache-control"] == "no-cache" and "content-security-policy" in r.headers
    again = await http.get("/ui/app.js", headers={"if-none-match": r.headers["etag"]})
    assert again.status_code == 304 and not again.content
    raw = await http.get("/ui/app.css", headers={"accept-encoding": "identity"})
    assert "content-encoding" not in raw.headers
    assert raw.content == (STATIC_DIR / "app.css").read_bytes()
    assert len(gzip.compress(raw.content)) < len(raw.content)


@pytest.mark.parametrize("path", ["/ui/nope.js", "/ui/index.html", "/ui/../pyproject.toml",
                                  "/ui/%2e%2e%2fpyproject.toml", "/ui/", "/ui/ui.py"])
async def test_nothing_else_is_served(http: httpx.AsyncClient, path: str) -> None:
    assert (await http.get(path)).status_code == 404


async def test_the_api_is_unchanged_beside_the_ui(http: httpx.AsyncClient, models) -> None:
    r = await http.get("/v1/models")
    assert r.status_code == 200 and "content-security-policy" not in r.headers
    assert {m.model for m in models} <= {m["id"] for m in r.json()["data"]}


async def test_off_by_default(bus) -> None:
    settings = gateway_settings()
    assert settings.ui is False
    app = create_app(settings, bus, make_store(None))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        assert (await client.get("/")).status_code == 404
        assert (await client.get("/ui/app.js")).status_code == 404
