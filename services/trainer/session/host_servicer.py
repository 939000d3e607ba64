"""One TrainerService for every session on a shared LoRA host: each call goes to its session.

A call names its session (``call.session_id``; ``session_id`` for GetSessionInfo); the host's
``SessionServicer`` of that session answers it, admitting its own job token or a user of its
tenant as for a session in a process of its own. A session not here is NOT_FOUND, the same
answer as for a session of another tenant. ``HostAuthenticator`` admits the job token of every
hosted session (a session joins with its token, leaves with it) and the worker's credential
for this host, the only caller of OpenHostedSession (host_process.py).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import grpc

from opentinker.errors import AuthenticationError, NotFoundError, PermissionDeniedError
from opentinker.services.common.auth import (
    IdentityServiceAuthenticator,
    Principal,
    current_principal,
    parse_credential,
)
from opentinker.services.common.grpc_server import abort_with
from opentinker.services.trainer.session.servicer import SessionServicer
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc


class HostAuthenticator:
    """The worker's credential for this host and the job tokens of the sessions on it (checked
    locally, in constant time), else a user's key the scheduler's IdentityService vouches for."""

    def __init__(self, worker_credential: str, identity: IdentityServiceAuthenticator) -> None:
        parsed = parse_credential(worker_credential)
        if parsed is None or parsed[0] != "worker":
            raise AuthenticationError("the host's worker credential is not a worker credential")
        self.worker = Principal(kind="worker", key_prefix=parsed[1])
        self._worker_credential = worker_credential
        self._identity = identity
        self._tokens: dict[str, tuple[str, int]] = {}  # token -> (job id, attempt)

    def admit(self, token: str, *, job_id: str, attempt: int) -> None:
        if parse_credential(token) is None:
            raise AuthenticationError(f"session {job_id}: its job token is malformed")
        self._tokens[token] = (job_id, attempt)

    def revoke(self, job_id: str) -> None:
        self._tokens = {t: owner for t, owner in self._tokens.items() if owner[0] != job_id}

    async def authenticate(self, credential: str) -> Principal:
        if hmac.compare_digest(credential.encode(), self._worker_credential.encode()):
            return self.worker
        for token, (job_id, attempt) in list(self._tokens.items()):
            if hmac.compare_digest(credential.encode(), token.encode()):
                parsed = parse_credential(token)
                assert parsed is not None  # checked in admit
                return Principal(
                    kind=parsed[0], key_prefix=parsed[1], job_id=job_id, attempt=attempt
                )
        return await self._identity.authenticate(credential)


class HostedRunner(Protocol):
    """Runs one handed-over session to its end (host_process.py): the stream's messages."""

    def hosted(
        self, request: trainer_pb2.OpenHostedSessionRequest
    ) -> AsyncIterator[trainer_pb2.OpenHostedSessionResponse]: ...


class HostServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Routes each call to the servicer of the session it names (see the module docstring)."""

    def __init__(
        self,
        sessions: Mapping[str, SessionServicer],
        runner: HostedRunner,
        worker: Principal,
    ) -> None:
        self._sessions = sessions  # the host's live map: sessions join and leave
        self._runner = runner
        self._worker = worker

    async def OpenHostedSession(self, request, context):  # noqa: N802 - gRPC method name
        p = current_principal()
        if p.kind != "worker" or p.key_prefix != self._worker.key_prefix:
            await abort_with(
                context,
                PermissionDeniedError(
                    f"{p.describe()} may not hand sessions to this host: only the worker that "
                    "started it",
                    reason="NOT_THE_HOSTS_WORKER",
                ),
            )
        async for message in self._runner.hosted(request):
            yield message

    async def _of(self, session_id: str, context: grpc.aio.ServicerContext) -> SessionServicer:
        servicer = self._sessions.get(session_id)
        if servicer is None:
            p = current_principal()
            await abort_with(
                context,
                NotFoundError(
                    f"no session {session_id!r} here for {p.describe()}", reason="NO_SESSION"
                ),
            )
        return servicer  # type: ignore[return-value]  # abort_with does not return

    async def Forward(self, request, context):  # noqa: N802
        return await (await self._of(request.call.session_id, context)).Forward(request, context)

    async def ForwardBackward(self, request, context):  # noqa: N802
        servicer = await self._of(request.call.session_id, context)
        return await servicer.ForwardBackward(request, context)

    async def OptimStep(self, request, context):  # noqa: N802
        servicer = await self._of(request.call.session_id, context)
        return await servicer.OptimStep(request, context)

    async def Sample(self, request, context):  # noqa: N802
        return await (await self._of(request.call.session_id, context)).Sample(request, context)

    async def SaveWeightsForSampler(self, request, context):  # noqa: N802
        servicer = await self._of(request.call.session_id, context)
        return await servicer.SaveWeightsForSampler(request, context)

    async def SaveState(self, request, context):  # noqa: N802
        servicer = await self._of(request.call.session_id, context)
        return await servicer.SaveState(request, context)

    async def LoadState(self, request, context):  # noqa: N802
        servicer = await self._of(request.call.session_id, context)
        return await servicer.LoadState(request, context)

    async def CloseSession(self, request, context):  # noqa: N802
        servicer = await self._of(request.call.session_id, context)
        return await servicer.CloseSession(request, context)

    async def GetSessionInfo(self, request, context):  # noqa: N802
        servicer = await self._of(request.session_id, context)
        return await servicer.GetSessionInfo(request, context)

    async def GetTrainerStatus(self, request, context):  # noqa: N802
        """The calling job's session (a job token names it)."""
        return await (await self._of(current_principal().job_id, context)).GetTrainerStatus(
            request, context
        )
