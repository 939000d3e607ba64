"""Whether a job process still answers: its gRPC health service, asked with a deadline.

A process stopped (SIGSTOP) or frozen still has its port: the kernel accepts the connection, and
nothing answers, so the check ends at its deadline ("silent": hung). A port nobody listens on
refuses at once ("unreachable": the process is gone, dying or not serving; its exit says why).
"""

from __future__ import annotations

from typing import Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from opentinker.services.common.grpc_server import aio_channel

Health = Literal["serving", "silent", "unreachable"]


async def check(address: str, *, timeout_s: float) -> Health:
    """How the server at ``address`` answers a health check within ``timeout_s``."""
    channel = aio_channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError as err:
        return "silent" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "unreachable"
    finally:
        await channel.close()
    return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "unreachable"
