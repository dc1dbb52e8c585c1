"""`python -m services.gateway`: the OpenAI-compatible HTTP gateway."""

from libs.common.service import run_forever
from libs.common.settings import GatewaySettings
from services.gateway.service import GatewayService

if __name__ == "__main__":
    settings = GatewaySettings()  # type: ignore[call-arg]  # fields come from the env
    run_forever("gateway", settings, lambda bus: GatewayService(settings, bus))
