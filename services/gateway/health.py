"""Liveness (`GET /health`) and readiness (`GET /ready`) of the gateway and what it serves.

Rules:
- /health is liveness: 200 while this process answers HTTP and its NATS connection is up; 503
  (with Retry-After) while the connection is being re-established. It reads nothing else (not
  the store, not other services): restarting the gateway is the cure only for what it reports.
- /ready is readiness: 503 once the process is draining (drain.py); else 200 only when the NATS
  connection is up, the store answers, at least one model is served, and every served model has
  a tokenizer and an engine that answer their own health probe within `ready_probe_timeout_s`,
  the engine's step loop having gone round within `engine_stall_s` (a wedged engine whose event
  loop still answers is not ready); a registered tools service must answer too. Otherwise 503
  with Retry-After and one line per reason. The body has the same shape either way (the
  `Readiness` JSON below).
- Served models and their instances come from the registry (announcements within
  model_ttl_s). Each instance is probed on its own subject: a killed one has no responder and
  counts as gone at once, a frozen one as silent after the timeout. Old announcements of a
  restarted instance do not matter while another instance of the same kind answers.
- Every probe runs concurrently, so /ready answers within about the probe timeout whatever
  is down.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import NoResponders
from flotilla.libs.common.errors import FlotillaError, envelope, unavailable
from flotilla.libs.common.messages import Announcement, HealthReply, HealthRequest

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState

router = APIRouter()
RETRY_AFTER_S = 1  # both checks are cheap: a poller may ask again in a second
HOPS = ("tokenizer", "engine")

State = Literal["ok", "gone", "silent", "stalled"]


@dataclass
class InstanceCheck:
    """One announced instance and how it answered its probe."""

    service: str
    instance: str
    model: str | None
    state: State
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    def describe(self) -> str:
        return f"{self.instance} {self.detail or self.state}"


@dataclass
class Readiness:
    ready: bool
    reasons: list[str]
    nats: bool
    store: str
    models: dict[str, bool] = field(default_factory=dict)
    instances: list[InstanceCheck] = field(default_factory=list)

    def body(self) -> dict[str, object]:
        return {"status": "ready" if self.ready else "not_ready", "reasons": self.reasons,
                "nats": "connected" if self.nats else "disconnected", "store": self.store,
                "models": self.models, "instances": [asdict(i) for i in self.instances]}


async def check_instance(gw: GatewayState, ann: Announcement) -> InstanceCheck:
    timeout = gw.settings.ready_probe_timeout_s
    check = InstanceCheck(ann.service, ann.instance, ann.model, "ok")
    try:
        reply = await gw.bus.request(subjects.instance_health(ann.service, ann.instance),
                                     HealthRequest(), HealthReply, timeout=timeout)
    except NoResponders:
        check.state, check.detail = "gone", "gone (no responder)"
        return check
    except FlotillaError:
        check.state, check.detail = "silent", f"not answering within {timeout:g}s"
        return check
    age = reply.heartbeat_age_s
    if age is not None and age > gw.settings.engine_stall_s:
        check.state, check.detail = "stalled", f"step loop stuck for {age:.1f}s"
    elif not reply.ok:
        check.state = "silent"
        check.detail = "draining" if reply.detail.get("draining") else "reports not ok"
    return check


def _hop_reasons(model: str, checks: list[InstanceCheck]) -> list[str]:
    reasons = []
    for hop in HOPS:
        mine = [c for c in checks if c.service == hop and c.model == model]
        if not any(c.ok for c in mine):
            why = "; ".join(c.describe() for c in mine) or "none announced"
            reasons.append(f"{model}: no {hop} answers ({why})")
    return reasons


async def readiness(gw: GatewayState) -> Readiness:
    """Every check /ready makes, as plain data."""
    store = gw.store.describe()
    if gw.drain.draining:
        return Readiness(False, ["the gateway is shutting down (draining)"],
                         nats=gw.bus.connected, store=store)
    if not gw.bus.connected:
        return Readiness(False, ["the gateway's NATS connection is down (reconnecting)"],
                         nats=False, store=store)
    try:
        await gw.store.ping()
        announced = await gw.registry.alive()
    except FlotillaError as exc:  # StoreUnavailable: its message names the store and cause
        return Readiness(False, [exc.info.message], nats=True, store=store)
    probed = [a for a in announced if a.service in (*HOPS, "tools")]
    checks = list(await asyncio.gather(*(check_instance(gw, a) for a in probed)))
    checks.sort(key=lambda c: (c.service, c.instance))
    models = sorted({c.model for c in checks if c.service in HOPS and c.model})
    reasons: list[str] = []
    verdicts = {}
    for model in models:
        lacking = _hop_reasons(model, checks)
        verdicts[model] = not lacking
        reasons += lacking
    if not models:
        reasons.append("no model is served yet (no tokenizer or engine has announced itself)")
    tools = [c for c in checks if c.service == "tools"]
    if tools and not any(c.ok for c in tools):
        reasons.append("no tools service answers ("
                       + "; ".join(c.describe() for c in tools) + ")")
    return Readiness(not reasons, reasons, nats=True, store=store, models=verdicts,
                     instances=checks)


def _gateway(request: Request) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


@router.get("/health")
async def health(request: Request) -> Response:
    if not _gateway(request).bus.connected:
        info = unavailable("the gateway's NATS connection is down (reconnecting)").info
        return JSONResponse(envelope(info), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    report = await readiness(_gateway(request))
    if report.ready:
        return JSONResponse(report.body())
    return JSONResponse(report.body(), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})
