"""Build gRPC servers and channels the same way in every service.

Every server has health checking and server reflection on, and the same message-size limits.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from opentinker import errors
from opentinker.auth import aio_interceptors, with_credential
from opentinker.errors import REASON_METADATA_KEY
from opentinker.grpc_options import (
    SERVER_KEEPALIVE_S,
    bind,
    channel_options,
    host_port,
    server_options,
)
from opentinker.services.common.tls import TlsSettings
from opentinker.services.common.undecodable import UndecodableRequestInterceptor
from opentinker.tls import channel_credentials, open_channel

# Weight updates travel in chunks well under opentinker.grpc_options.MAX_MESSAGE_BYTES; larger
# messages are refused with RESOURCE_EXHAUSTED by gRPC itself.

CHANNEL_OPTIONS = channel_options()


def create_aio_server(
    service_names: Iterable[str],
    *,
    host: str,
    port: int,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: TlsSettings | None = None,
    keepalive_s: float = SERVER_KEEPALIVE_S,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """An asyncio gRPC server bound to host:port (0 = any free port), with health + reflection.

    ``interceptors``: the service's AuthInterceptor (services/common/auth.py). ``tls``: serve
    TLS when it has a certificate (default: the OPENTINKER_TLS_* variables). Register
    servicers on the returned server before ``await server.start()``. ``keepalive_s``: how
    often it pings a silent client; one that does not answer within half of that is dropped
    and its calls end (opentinker/grpc_options.py). Returns (server, bound_port,
    health_servicer); every named service is marked SERVING.
    """
    server = grpc.aio.server(
        options=server_options(keepalive_s),
        # Innermost: a request that does not decode is refused (one log line) after the
        # caller's credential was checked, never with a traceback (undecodable.py).
        interceptors=[*interceptors, UndecodableRequestInterceptor()],
    )
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
    credentials = (tls or TlsSettings()).server_credentials()
    bound = bind(server, host_port(host, port), credentials)
    return server, bound, health_servicer


async def mark_serving(health_servicer: health.aio.HealthServicer, names: Iterable[str]) -> None:
    """Mark the overall server and each named service SERVING."""
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def aio_channel(address: str, *, credential: str = "") -> grpc.aio.Channel:
    """An asyncio channel with the project's limits and keepalives; every call carries
    ``credential`` (an API key, job token or worker token) when one is given. TLS when
    OPENTINKER_TLS_CA_FILE names the CA the services' certificates chain to."""
    interceptors = aio_interceptors(credential)
    tls = channel_credentials(TlsSettings().ca_file)
    if tls is None:
        return grpc.aio.insecure_channel(
            address, options=CHANNEL_OPTIONS, interceptors=interceptors
        )
    return grpc.aio.secure_channel(address, tls, options=CHANNEL_OPTIONS, interceptors=interceptors)


def sync_channel(address: str, *, credential: str = "") -> grpc.Channel:
    """A blocking channel with the project's limits and keepalives, sending ``credential``
    (TLS as for ``aio_channel``)."""
    channel = open_channel(address, ca_file=TlsSettings().ca_file, options=CHANNEL_OPTIONS)
    return with_credential(channel, credential)


async def abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, *, reason: str = ""
) -> NoReturn:
    """End the RPC with ``code`` and an actionable ``message``; ``reason`` is machine-readable."""
    if reason:
        context.set_trailing_metadata(((REASON_METADATA_KEY, reason),))
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers


# Domain error -> status code, most specific first (isinstance order).
_STATUS_OF_ERROR: list[tuple[type[errors.OpenTinkerError], grpc.StatusCode]] = [
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
]


async def abort_with(context: grpc.aio.ServicerContext, err: errors.OpenTinkerError) -> NoReturn:
    """End the RPC with the status code of ``err``'s class (INTERNAL for an unmapped one)."""
    code = next(
        (code for cls, code in _STATUS_OF_ERROR if isinstance(err, cls)), grpc.StatusCode.INTERNAL
    )
    await abort(context, code, err.message, reason=err.reason)


def rewrap_handler(
    handler: grpc.RpcMethodHandler,
    *,
    coroutine: Callable[[Callable[..., Any]], Callable[..., Any]],
    generator: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> grpc.RpcMethodHandler:
    """The same RPC handler with its behaviour wrapped, for server interceptors.

    A behaviour is either an async generator (it yields its responses) or a coroutine (it
    returns the response, or writes a stream with ``context.write``); grpc.aio drives a
    handler by that shape, so ``generator`` wraps the first kind and ``coroutine`` the second,
    each returning a behaviour of the same shape.
    """
    kind = next(
        k
        for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        if getattr(handler, k) is not None
    )
    inner = getattr(handler, kind)
    wrapped = generator(inner) if inspect.isasyncgenfunction(inner) else coroutine(inner)
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor for the calls of some services only (health and reflection answer
    for themselves): subclasses wrap each such handler in ``wrap``."""

    def __init__(self, *services: str) -> None:
        self._prefixes = tuple(f"/{service}/" for service in services)

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefixes):
            return handler
        return self.wrap(handler, method)
