"""`python -m flotilla.services.gateway`: the OpenAI-compatible HTTP gateway (one process, or a
parent of `FLOTILLA_GATEWAY_WORKERS` processes sharing the port: services/gateway/workers.py)."""

import sys

from flotilla.libs.common.service import run_forever
from flotilla.libs.common.settings import GatewaySettings
from flotilla.services.gateway.service import GatewayService
from flotilla.services.gateway.workers import WORKER_ARG, run_workers

if __name__ == "__main__":
    settings = GatewaySettings()  # type: ignore[call-arg]  # fields come from the env
    worker = WORKER_ARG in sys.argv  # one of several, started by run_workers
    if not worker and settings.gateway_workers > 1:
        sys.exit(run_workers(settings))
    run_forever("gateway", settings,
                lambda bus: GatewayService(settings, bus, reuse_port=worker))
