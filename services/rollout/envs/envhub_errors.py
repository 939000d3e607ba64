"""What a broken EnvHub stream means to the rollout: EnvHub's answer, or a lost link.

EnvHub answers a stream it will not serve with a status (NOT_FOUND: no such env; UNAVAILABLE
with reason ENV_UNAVAILABLE: no instance of the env answered; UNAUTHENTICATED, ...). A stream
that breaks any other way (UNAVAILABLE from the transport, CANCELLED, a failed write) lost its
link to EnvHub itself: EnvHub died, restarted, or the network dropped. That is an
``EnvLinkLostError``, which the rollout rides out by reconnecting (see ``envhub_link``).
"""

from __future__ import annotations

import grpc

from opentinker.errors import NotFoundError, OpenTinkerError, UnavailableError, from_rpc_error
from opentinker.services.rollout.agent.env_replies import EnvLinkLostError

ENV_UNAVAILABLE = "ENV_UNAVAILABLE"  # EnvHub's reason: no instance of the env answered
_LINK_LOST_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
)


def stream_error(err: BaseException, *, env_name: str, address: str) -> OpenTinkerError:
    """The error a broken stream of ``env_name`` via EnvHub at ``address`` stands for.

    err: the stream's ``AioRpcError``, or what a write raised (a timeout, a closed call).
    """
    if isinstance(err, grpc.aio.AioRpcError):
        code, details, reason = err.code(), err.details(), from_rpc_error(err).reason
    else:
        code, details, reason = None, repr(err), ""
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFoundError(
            f"environment '{env_name}' is not registered with EnvHub at {address}: {details}",
            code="NOT_FOUND",
            reason=reason,
        )
    lost = (code is None or code in _LINK_LOST_CODES) and reason != ENV_UNAVAILABLE
    code_name = "UNAVAILABLE" if lost or code is None else code.name
    return (EnvLinkLostError if lost else UnavailableError)(
        f"episode stream of environment '{env_name}' via EnvHub at {address} failed: "
        f"{code.name if code is not None else 'UNAVAILABLE'}: {details}",
        code=code_name,
        reason=reason,
    )
