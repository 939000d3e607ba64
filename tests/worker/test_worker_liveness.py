"""The worker's health check of a job process (worker/liveness.py): a serving process, a port
nobody listens on (gone or not serving: its exit says why) and a process that accepts the
connection but answers nothing (stopped or frozen: hung) are told apart, the last at the check's
deadline."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from opentinker.services.common.grpc_server import create_aio_server, mark_serving
from opentinker.services.worker.liveness import check

pytestmark = pytest.mark.integration


def test_serving_unreachable_and_silent_are_told_apart() -> None:
    async def scenario() -> None:
        server, port, health = create_aio_server([], host="127.0.0.1", port=0)
        await server.start()
        await mark_serving(health, [])
        try:
            assert await check(f"127.0.0.1:{port}", timeout_s=5) == "serving"
        finally:
            await server.stop(0)
        assert await check(f"127.0.0.1:{port}", timeout_s=5) == "unreachable"
        with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, answers nothing
            started = time.monotonic()
            assert await check(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=1) == "silent"
            assert 0.9 <= time.monotonic() - started < 5

    asyncio.run(scenario())
