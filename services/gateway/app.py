"""The gateway's ASGI application: `create_app(settings, bus, store)`.

Rules:
- The app is built synchronously and holds a `GatewayState` (settings, bus, store, spec,
  registry, tools cache) on `app.state.gateway`; whoever runs the app awaits `state.start()`
  before serving (to follow announcements) and `state.stop()` after. `GatewayService` does both.
- FastAPI's generated OpenAPI and docs are off: `/openapi.json` serves our spec file, with the
  server's limits written into its `x-limit` bounds.
- `InFlightLimit` (overload.py) caps the generation and tokenize requests in flight in this
  process; the count lives in `GatewayState.in_flight`.
- `/metrics` serves the gateway's Prometheus metrics (metrics.py); `MetricsMiddleware`
  (outermost but for tracing) counts every request, refusals of the key checks included, and
  `DrainGate` refuses new ones once a drain began (drain.py), before any key check.
- With `settings.ui` the chat web UI is served at `/` (services/gateway/ui.py).
- `ApiKeyAuth` (auth.py) checks API keys and per-key limits outside the in-flight cap (a
  request without a key takes no slot); CORS headers (`cors_origins`) are off unless set, and
  preflights are answered before authentication (a browser sends them without the key).
- FastAPI's own telemetry (newer FastAPI: a server span plus dependency and endpoint spans per
  request) is off: `TracingMiddleware`'s `gateway.request` is the gateway's one span per request;
  the three extra spans cost ~0.8 ms of CPU per streamed request (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from flotilla.libs.common.bus import Bus
from flotilla.libs.common.errors import FlotillaError, invalid_request, model_not_found, unavailable
from flotilla.libs.common.model_capabilities import Capability
from flotilla.libs.common.settings import GatewaySettings
from flotilla.libs.common.store import Store
from flotilla.services.gateway import http_errors
from flotilla.services.gateway.anthropic.routes import router as anthropic_router
from flotilla.services.gateway.api_keys import KeyRing
from flotilla.services.gateway.auth import ApiKeyAuth
from flotilla.services.gateway.conversations.routes import install as install_conversations
from flotilla.services.gateway.drain import Drain, DrainGate
from flotilla.services.gateway.health import router as health_router
from flotilla.services.gateway.limits import spec_limits
from flotilla.services.gateway.metrics import GatewayMetrics, MetricsMiddleware
from flotilla.services.gateway.metrics import router as metrics_router
from flotilla.services.gateway.overload import InFlight, InFlightLimit
from flotilla.services.gateway.pooling_routes import router as pooling_router
from flotilla.services.gateway.rate_limits import Limiter, make_limiter
from flotilla.services.gateway.registry import ModelInfo, ModelRegistry
from flotilla.services.gateway.responses.routes import install as install_responses
from flotilla.services.gateway.routes import router
from flotilla.services.gateway.spec import Spec
from flotilla.services.gateway.token_routes import router as token_router
from flotilla.services.gateway.tools import ToolsCache
from flotilla.services.gateway.tracing import TracingMiddleware
from flotilla.services.gateway.ui import load_assets, ui_router


@dataclass
class GatewayState:
    settings: GatewaySettings
    bus: Bus
    store: Store
    spec: Spec
    registry: ModelRegistry
    tools: ToolsCache
    in_flight: InFlight
    keys: KeyRing
    limiter: Limiter
    metrics: GatewayMetrics
    drain: Drain

    async def start(self) -> None:
        await self.tools.start()
        await self.registry.start()  # its discovery ping makes the tools service announce too

    async def stop(self) -> None:
        await self.registry.stop()
        await self.tools.stop()

    async def require_model(self, model: str, serves: Capability | None = None) -> ModelInfo:
        """The served model, else 404; 503 when the registry itself cannot be read; 400
        naming `model` where it cannot serve `serves` (an embedding model asked to chat)."""
        try:
            info = await self.registry.get(model)
        except FlotillaError:  # an unreachable store: 503 with Retry-After, named
            raise
        except Exception as exc:
            raise unavailable(f"the model registry is unavailable: {exc}") from exc
        if info is None:
            raise model_not_found(model)
        reason = info.cannot(serves) if serves is not None else None
        if reason is not None:
            raise invalid_request(reason, param="model", code="model_not_supported")
        return info


def create_app(settings: GatewaySettings, bus: Bus, store: Store) -> FastAPI:
    spec = Spec.load(settings.spec_path, limits=spec_limits(settings))
    app = FastAPI(title="flotilla", version=str(spec.document["info"]["version"]),
                  openapi_url=None, docs_url=None, redoc_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.gateway = GatewayState(
        settings, bus, store, spec, ModelRegistry(bus, store, settings.model_ttl_s),
        ToolsCache(bus, settings.tools_timeout_s, settings.tools_cache_ttl_s),
        InFlight(settings.max_in_flight), KeyRing.from_settings(settings, store),
        make_limiter(store), GatewayMetrics(settings.prometheus_multiproc_dir),
        Drain(settings.overload_retry_after_s))
    http_errors.install(app)
    app.include_router(router)
    app.include_router(anthropic_router)
    install_responses(app)
    install_conversations(app)
    app.include_router(token_router)
    app.include_router(pooling_router)
    app.add_middleware(InFlightLimit, in_flight=app.state.gateway.in_flight,
                       retry_after_s=settings.overload_retry_after_s)
    app.include_router(health_router)
    app.include_router(metrics_router)
    if settings.ui:
        app.include_router(ui_router(load_assets()))
    state = app.state.gateway
    app.add_middleware(ApiKeyAuth, keys=state.keys, limiter=state.limiter, settings=settings,
                       on_rate_limited=lambda record, kind: state.metrics.rate_limit_hit(
                           record.id, kind))
    app.add_middleware(DrainGate, drain=state.drain)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=[
            o.strip() for o in settings.cors_origins.split(",") if o.strip()],
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"],
            expose_headers=["*"])
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.add_middleware(TracingMiddleware)
    return app
