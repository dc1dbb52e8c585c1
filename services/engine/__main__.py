"""`python -m services.engine`: run one engine pod until SIGTERM."""

from libs.common.service import run_forever
from libs.common.settings import EngineSettings
from services.engine.service import EngineService


def main() -> None:
    settings = EngineSettings()
    run_forever("engine", settings, lambda bus: EngineService(settings, bus))


if __name__ == "__main__":
    main()
