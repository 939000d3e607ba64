"""`python -m opentinker.services.gateway` (`opentinker serve tinker-gateway`): settings from
OPENTINKER_GATEWAY_* -> the Tinker HTTP API on host:port until SIGTERM/SIGINT."""

from __future__ import annotations

import uvicorn

from opentinker.services.common.logging import configure_logging
from opentinker.services.gateway.app import create_app
from opentinker.services.gateway.settings import GatewaySettings


def main() -> None:
    settings = GatewaySettings()
    log = configure_logging("gateway", level=settings.log_level)
    log.info(
        "serving", host=settings.host, port=settings.port, scheduler=settings.scheduler_address
    )
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
