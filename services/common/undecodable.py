"""A request that does not decode costs one log line, not a traceback.

Left to itself, grpc.aio deserializes a request before the handler runs and, when the bytes are
no message of the method's type, logs ``Unexpected [DecodeError] raised by servicer method``
with a full traceback (logger ``grpc._cython.cygrpc``) and answers UNKNOWN: any caller could
inflate a service's log by sending garbage. ``UndecodableRequestInterceptor``, the innermost
interceptor of every server create_aio_server builds, wraps each method's request deserializer:

- a unary request that does not decode reaches the handler as a marker, and the call ends
  INVALID_ARGUMENT before the servicer runs;
- a message of a request stream that does not decode raises ``UndecodableRequestError`` where
  the servicer reads it (its iterator or ``context.read()``), and the call ends the same way.

Either way one structlog line ``undecodable_request`` (method, peer, error type) is written. It
is the innermost interceptor, so a caller without a valid credential is refused first.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

from opentinker.errors import REASON_METADATA_KEY, InvalidArgumentError

log = structlog.get_logger(__name__)

REASON = "UNDECODABLE_REQUEST"


class UndecodableRequestError(InvalidArgumentError):
    """A message of a request stream is not a serialized message of the method's type."""

    def __init__(self, message: str, *, code: str = "", reason: str = REASON) -> None:
        super().__init__(message, code=code, reason=reason)


class _Undecodable:
    """What a unary request that did not decode reaches the handler as."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


async def _refuse(context: grpc.aio.ServicerContext, method: str, error: BaseException) -> None:
    log.warning(
        "undecodable_request",
        method=method,
        peer=context.peer(),
        error=type(error).__name__,
    )
    # As grpc_server.abort does (it cannot be imported here: grpc_server imports this module).
    context.set_trailing_metadata(((REASON_METADATA_KEY, REASON),))
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{method}: the request is not a serialized message of the method's request type "
        f"({_describe(error)}); send the request message the method's proto declares",
    )


def _unary_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def guarded(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as err:  # any failure to decode: the handler refuses the call
            return _Undecodable(err)

    return guarded


def _stream_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def guarded(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as err:  # raised where the servicer reads; the wrapper refuses
            raise UndecodableRequestError(_describe(err)) from err

    return guarded


def _guarded_behavior(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """``behavior`` of the same shape (async generator or coroutine), refusing undecodable
    requests: a unary one before it runs, a streamed one where it is read."""
    if inspect.isasyncgenfunction(behavior):

        async def generator(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(context, method, request.error)
            try:
                async for response in behavior(request, context):
                    yield response
            except UndecodableRequestError as err:
                await _refuse(context, method, err.__cause__ or err)

        return generator

    async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(context, method, request.error)
        try:
            return await behavior(request, context)
        except UndecodableRequestError as err:
            await _refuse(context, method, err.__cause__ or err)

    return coroutine


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Every method of the server: an undecodable request is one log line and
    INVALID_ARGUMENT (module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        unary_request = not handler.request_streaming
        kind = ("unary" if unary_request else "stream") + (
            "_stream" if handler.response_streaming else "_unary"
        )
        inner = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner)):
            return handler  # a synchronous behaviour (none of ours): left as grpc runs it
        deserialize = (_unary_deserializer if unary_request else _stream_deserializer)(
            handler.request_deserializer
        )
        behavior = _guarded_behavior(inner, handler_call_details.method)
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(
            behavior,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )
