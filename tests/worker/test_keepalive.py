"""A peer that vanishes without closing its connection (powered off, stopped, cut off) is
noticed by keepalive on both sides (opentinker/grpc_options.py). A server drops such a client
and its calls end, so what they held is let go (an EnvHub stream's episodes, an env server's
games); a client's call to such a server fails UNAVAILABLE instead of waiting. Before, gRPC's
defaults kept a vanished client two hours, and a client waited on a vanished server for well
over a minute. The peer is a real process stopped with SIGSTOP: its kernel keeps the TCP
connection up, only the process is gone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import pytest
from async_guard import run

from opentinker.grpc_options import channel_options
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
            await asyncio.wait_for(ended.wait(), 10)  # ping every 1 s, answer due in 0.5 s
        finally:
            client.kill()
            client.wait()
            await server.stop(0)

    run(main, 60)


SERVER = """
import threading
from concurrent import futures
import grpc
from opentinker.grpc_options import server_options
def hold(requests, context):
    yield b"opened"
    threading.Event().wait()
server = grpc.server(futures.ThreadPoolExecutor(2), options=server_options())
methods = {"Hold": grpc.stream_stream_rpc_method_handler(hold)}
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Hold", methods),))
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
server.wait_for_termination()
"""


def test_a_call_to_a_server_that_stops_answering_fails_unavailable() -> None:
    async def main() -> None:
        server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        options = channel_options(keepalive_s=1.0)
        try:
            port = int(server.stdout.readline())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:

                async def requests():
                    yield b"open"
                    await asyncio.Event().wait()

                call = channel.stream_stream("/test.Hold/Hold")(requests())
                assert await call.read() == b"opened"
                os.kill(server.pid, signal.SIGSTOP)
                with pytest.raises(grpc.aio.AioRpcError) as lost:  # gRPC's defaults: > 60 s
                    await asyncio.wait_for(call.read(), 10)
                assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            server.kill()
            server.wait()

    run(main, 60)
