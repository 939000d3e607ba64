"""``python -m opentinker.services.dashboard``: settings -> app -> serve over HTTP."""

from __future__ import annotations

import socket

import uvicorn

from opentinker.services.common.launch import publish_address
from opentinker.services.common.logging import configure_logging
from opentinker.services.dashboard.app import create_app
from opentinker.services.dashboard.settings import DashboardSettings


def main() -> None:
    settings = DashboardSettings()
    log = configure_logging("dashboard", level=settings.log_level)
    app = create_app(settings)
    # Its own socket, so that the port it got (port 0: any free one) is known and said; a
    # connection made before uvicorn accepts waits in the socket's backlog
    host = settings.host.removeprefix("[").removesuffix("]")  # "[::1]" as in a URL
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # "::" as uvicorn does
    listening = socket.create_server((host, settings.port), family=family)
    port = listening.getsockname()[1]
    log.info("serving", host=settings.host, port=port,
             scheduler=settings.scheduler_address, envhub=settings.envhub_address)  # fmt: skip
    publish_address(settings.address_file, settings.host, port)
    # uvicorn handles SIGTERM/SIGINT: it stops taking requests and ends open ones.
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])


if __name__ == "__main__":
    main()
