"""Bytes that are no message of a method's request type cost one log line, not a traceback, on
every server create_aio_server builds (services/common/undecodable.py): a fuzzer with a valid
key could otherwise fill a service's log (issue 37: 644 tracebacks on the scheduler).

A real scheduler (gRPC + Redis), called with raw bytes through generic channel calls (identity
serializers), for each kind of method; and a bare server's health and reflection methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from async_guard import run
from scheduler_helpers import scheduler_mesh

from opentinker.common.v1 import common_pb2
from opentinker.errors import REASON_METADATA_KEY
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.common.grpc_server import create_aio_server

pytestmark = pytest.mark.integration

GARBAGE = b"\xff\xff\xff\xff\x0f"
SCHEDULER = "/opentinker.scheduler.v1.SchedulerService"


async def _messages(*messages: bytes) -> AsyncIterator[bytes]:
    for message in messages:
        yield message


async def refused(call) -> grpc.aio.AioRpcError:  # noqa: ANN001 - an RPC in progress
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert "not a serialized message" in err.details()
    assert (REASON_METADATA_KEY, "UNDECODABLE_REQUEST") in tuple(err.trailing_metadata())
    return err


def assert_one_line_each(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    methods: list[str],
    *,
    also: str = "",
) -> list[str]:
    """One ``undecodable_request`` line per method and no traceback; the lines with ``also``."""
    out, err = capsys.readouterr()
    text = out + err + caplog.text
    assert "Traceback" not in text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    lines = [line for line in (out + err).splitlines() if "undecodable_request" in line]
    assert len(lines) == len(methods), lines
    for line, method in zip(lines, methods, strict=True):
        assert method in line and "DecodeError" in line and "127.0.0.1" in line
    return [line for line in (out + err).splitlines() if also and also in line]


def test_undecodable_requests_to_the_scheduler_are_one_log_line_each(
    redis_url: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    methods = [f"{SCHEDULER}/SubmitJob", f"{SCHEDULER}/WatchJob", f"{SCHEDULER}/ConnectWorker"]

    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            user, worker, *_ = mesh.channels  # a user's, then the worker tokens'
            capsys.readouterr()
            await refused(user.unary_unary(methods[0])(GARBAGE, timeout=5))
            await refused(user.unary_stream(methods[1])(GARBAGE, timeout=5))
            await refused(worker.stream_stream(methods[2])(_messages(GARBAGE), timeout=5))
            # A good `register`, then garbage on the live stream: the servicer's reader meets
            # the error and ends the stream, in a line of its own (worker_stream_broken).
            register = scheduler_pb2.ConnectWorkerRequest(
                seq=1,
                register=scheduler_pb2.RegisterWorker(
                    worker_id="w1",
                    hostname="h",
                    devices=[scheduler_pb2.Device(device_id="w1/cpu:0", kind="cpu")],
                ),
            ).SerializeToString()
            heartbeat = scheduler_pb2.ConnectWorkerRequest(
                seq=2, heartbeat=common_pb2.Heartbeat(time_unix_s=time.time())
            ).SerializeToString()
            call = worker.stream_stream(methods[2])(
                _messages(register, heartbeat, GARBAGE), timeout=5
            )
            async for raw in call:
                message = scheduler_pb2.ConnectWorkerResponse.FromString(raw)
                assert message.HasField("registered") or message.HasField("heartbeat")
            # The service goes on answering good requests.
            assert await mesh.stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=5)

    run(main)
    broken = assert_one_line_each(capsys, caplog, methods, also="worker_stream_broken")
    assert len(broken) == 1 and "UndecodableRequestError" in broken[0]


def test_undecodable_requests_to_health_and_reflection_are_one_log_line_each(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Every service's server comes from create_aio_server: the methods it adds itself."""
    caplog.set_level(logging.INFO)
    check = "/grpc.health.v1.Health/Check"
    reflect = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

    async def main() -> None:
        server, port, _ = create_aio_server([], host="127.0.0.1", port=0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                capsys.readouterr()
                await refused(channel.unary_unary(check)(GARBAGE, timeout=5))
                await refused(channel.stream_stream(reflect)(_messages(GARBAGE), timeout=5))
        finally:
            await server.stop(0)

    run(main)
    assert_one_line_each(capsys, caplog, [check, reflect])
