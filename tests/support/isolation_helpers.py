"""What the isolation tests share: the kinds of bad credential, the status codes they expect,
and ``outcome``, one call's status (retrying gRPC core's rare INTERNAL race on refused
streams). Used by test_isolation.py (the scheduler's services) and test_isolation_services.py
(EnvHub, trainer, rollout).
"""

import asyncio
from collections.abc import Awaitable, Callable

import grpc

OK = None
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND
MALFORMED = "not-a-key"
UNKNOWN = "otk_0123456789ab_" + "x" * 43

Call = Callable[[grpc.aio.Channel], Awaitable[object]]


async def outcome(call: Call, channel: grpc.aio.Channel) -> tuple[grpc.StatusCode | None, object]:
    """(status code or None for OK, the reply).

    A server that refuses a bidirectional stream while the client's first message is still in
    flight ends it, about once in 300 tries, with INTERNAL "Internal error from Core" instead
    of the status it set (a race inside gRPC core, seen in loops of 300 refused calls on the
    rollout's Rollout stream; catching the abort server-side does not change it). Such a call
    is made again, up to three times; any other status is the answer.
    """
    for _ in range(3):
        try:
            return OK, await asyncio.wait_for(call(channel), 10)
        except grpc.aio.AioRpcError as err:
            core_race = err.code() is grpc.StatusCode.INTERNAL and "from Core" in err.details()
            if not core_race:
                return err.code(), None
    return grpc.StatusCode.INTERNAL, None
