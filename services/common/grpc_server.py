"""Build gRPC servers and channels the same way in every service.

Every server has health checking and server reflection on, and the same message-size limits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from opentinker.errors import REASON_METADATA_KEY

# Weight updates travel in chunks well under this; larger messages are refused with
# RESOURCE_EXHAUSTED by gRPC itself.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def create_aio_server(
    service_names: Iterable[str],
    *,
    host: str,
    port: int,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """An asyncio gRPC server bound to host:port (0 = any free port), with health + reflection.

    Register servicers on the returned server before ``await server.start()``. Returns
    (server, bound_port, health_servicer); every named service is marked SERVING.
    """
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=list(interceptors))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind a gRPC server to {host}:{port}")
    return server, bound, health_servicer


async def mark_serving(health_servicer: health.aio.HealthServicer, names: Iterable[str]) -> None:
    """Mark the overall server and each named service SERVING."""
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def aio_channel(address: str) -> grpc.aio.Channel:
    """An insecure asyncio channel with the project's limits and keepalives."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def sync_channel(address: str) -> grpc.Channel:
    """An insecure blocking channel with the project's limits and keepalives."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


async def abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, *, reason: str = ""
) -> NoReturn:
    """End the RPC with ``code`` and an actionable ``message``; ``reason`` is machine-readable."""
    if reason:
        context.set_trailing_metadata(((REASON_METADATA_KEY, reason),))
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers
