"""`python -m flotilla.services.engine`: run one engine pod until SIGTERM, or until its engine
breaks (exit status 1, so a supervisor restarts it).

Under torchrun (multi-host tensor parallelism) every rank runs this module: rank 0 serves as
usual, the other ranks become workers of rank 0's pod (docs/tensor_parallel.md).
"""

import os
import signal
import sys

from flotilla.libs.common import telemetry
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.service import run_forever
from flotilla.libs.common.settings import EngineSettings
from flotilla.services.engine.service import EngineService


def _torchrun_worker(settings: EngineSettings) -> None:
    from flotilla.libs.common.model_cache import resolve_model
    from flotilla.services.engine.factory import engine_config
    from flotilla.services.engine.worker import run_torchrun_worker

    telemetry.setup_logging(settings.log_level)
    path = resolve_model(settings.model)
    run_torchrun_worker(engine_config(settings, path), str(path))


def main() -> None:
    settings = EngineSettings()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0:
        _torchrun_worker(settings)
        return
    services: list[EngineService] = []

    def build(bus: Bus) -> EngineService:
        service = EngineService(settings, bus,
                                on_fatal=lambda: os.kill(os.getpid(), signal.SIGTERM))
        services.append(service)
        return service

    run_forever("engine", settings, build)
    if services and services[0].crashed is not None:
        sys.stdout.flush()
        os._exit(1)  # the engine thread may still sit in a dead collective: do not wait for it


if __name__ == "__main__":
    main()
