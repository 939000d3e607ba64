"""A Tinker gateway served by uvicorn in a thread of the test process, in front of a mesh."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from opentinker.services.gateway.app import create_app
from opentinker.services.gateway.settings import GatewaySettings


@contextlib.contextmanager
def running_gateway(settings: GatewaySettings) -> Iterator[str]:
    """Serve the gateway on a free port; yields its base URL (http://127.0.0.1:<port>)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="tinker-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
