"""A client host that vanishes without closing its connection (powered off, stopped, cut off)
is dropped by our servers' keepalive, and its calls end, so what they held is let go (an
EnvHub stream's episodes, an env server's games). Before, gRPC's defaults kept them two hours:
a server sent keepalive pings only every two hours, at most one per 5 minutes without data,
and waited 60 s for an answer. A real gRPC server (create_aio_server) and a client process,
stopped with SIGSTOP: its kernel keeps the TCP connection up, only the client is gone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from async_guard import run

from opentinker.services.common.grpc_server import create_aio_server

pytestmark = pytest.mark.integration

CLIENT = """
import sys, threading, grpc
channel = grpc.insecure_channel(sys.argv[1])
def requests():
    yield b"open"
    threading.Event().wait()  # the stream stays open, sending nothing more
for _ in channel.stream_stream("/test.Hold/Hold")(requests()):
    print("opened", flush=True)
"""


def test_a_client_that_stops_answering_is_dropped_and_its_call_ends() -> None:
    async def main() -> None:
        opened, ended = asyncio.Event(), asyncio.Event()

        async def hold(requests, context):  # noqa: ANN001
            opened.set()
            try:
                yield b"opened"
                async for _ in requests:
                    pass
                await asyncio.Event().wait()
            finally:
                ended.set()

        handler = grpc.method_handlers_generic_handler(
            "test.Hold", {"Hold": grpc.stream_stream_rpc_method_handler(hold)}
        )
        server, port, _ = create_aio_server([], host="127.0.0.1", port=0, keepalive_s=1.0)
        server.add_generic_rpc_handlers((handler,))
        await server.start()
        client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"])
        try:
            await asyncio.wait_for(opened.wait(), 30)
            await asyncio.sleep(3.0)  # three keepalive rounds: a client that answers stays
            assert not ended.is_set()
            os.kill(client.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            await asyncio.wait_for(ended.wait(), 10)  # ping every 1 s, answer due in 0.5 s
            assert time.monotonic() - stopped < 5
        finally:
            client.kill()
            client.wait()
            await server.stop(0)

    run(main, 60)
