"""A Tinker gateway served by uvicorn in a thread of this process (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from opentinker.grpc_options import host_port
from opentinker.services.gateway.app import create_app
from opentinker.services.gateway.settings import GatewaySettings


@contextlib.contextmanager
def running_gateway(settings: GatewaySettings) -> Iterator[str]:
    """Serve the gateway on settings.host:port (port 0: a free one); yields its base URL."""
    port = settings.port
    if port == 0:
        with socket.socket() as s:
            s.bind((settings.host, 0))
            port = s.getsockname()[1]
    config = uvicorn.Config(
        create_app(settings), host=settings.host, port=port, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="tinker-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True  # a slow start: not left serving behind the error
            thread.join(timeout=30)
            raise RuntimeError(
                f"the Tinker gateway could not serve on {host_port(settings.host, port)} "
                "(uvicorn's error above says why; most often another program holds the port): "
                "free it or choose another (`opentinker up --gateway-port`, "
                "OPENTINKER_GATEWAY_PORT)"
            )
        time.sleep(0.05)
    try:
        yield f"http://{host_port(settings.host, port)}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
