"""While Redis is away, every scheduler RPC ends UNAVAILABLE with a message a person can act on.

The scheduler's state lives in Redis only; when Redis restarts, calls that need it fail with a
redis ConnectionError/TimeoutError. Without this interceptor gRPC would answer UNKNOWN and log
a traceback. With it, callers see ``UNAVAILABLE: the scheduler cannot reach its Redis ... retry``
and retry (the trainer's reporter and the worker agent do so by themselves).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from opentinker.services.common.grpc_server import ServiceInterceptor, abort, rewrap_handler

log = structlog.get_logger(__name__)

STORE_ERRORS = (RedisConnectionError, RedisTimeoutError)


def outage_message(err: BaseException) -> str:
    return (
        f"the scheduler cannot reach its Redis ({type(err).__name__}: {err}); no job is lost, "
        "retry in a few seconds"
    )


async def _abort_unavailable(
    context: grpc.aio.ServicerContext, method: str, err: BaseException
) -> None:
    log.warning("store_unavailable", method=method, error=repr(err))
    await abort(
        context, grpc.StatusCode.UNAVAILABLE, outage_message(err), reason="STORE_UNAVAILABLE"
    )


def _guarded_coroutine(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except STORE_ERRORS as err:
                await _abort_unavailable(context, method, err)

        return guarded

    return wrap


def _guarded_generator(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for response in behavior(request, context):
                    yield response
            except STORE_ERRORS as err:
                await _abort_unavailable(context, method, err)

        return guarded

    return wrap


class StoreOutageInterceptor(ServiceInterceptor):
    """Turns a Redis connection error escaping a handler of ``services`` into UNAVAILABLE."""

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return rewrap_handler(
            handler, coroutine=_guarded_coroutine(method), generator=_guarded_generator(method)
        )
