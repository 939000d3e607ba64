"""``python -m opentinker.services.dashboard``: settings -> app -> serve over HTTP."""

from __future__ import annotations

import uvicorn

from opentinker.services.common.logging import configure_logging
from opentinker.services.dashboard.app import create_app
from opentinker.services.dashboard.settings import DashboardSettings


def main() -> None:
    settings = DashboardSettings()
    log = configure_logging("dashboard", level=settings.log_level)
    app = create_app(settings)
    log.info("serving", host=settings.host, port=settings.port,
             scheduler=settings.scheduler_address, envhub=settings.envhub_address)  # fmt: skip
    # uvicorn handles SIGTERM/SIGINT: it stops taking requests and ends open ones.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
