"""Whether a job process still answers: its gRPC health service, asked with a deadline.

A process stopped (SIGSTOP), frozen or with its event loop blocked accepts the connection (the
kernel does) but answers nothing; the check then ends at its deadline.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from opentinker.services.common.grpc_server import aio_channel


async def answers(address: str, *, timeout_s: float) -> bool:
    """True when the server at ``address`` says SERVING within ``timeout_s``."""
    channel = aio_channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    finally:
        await channel.close()
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
