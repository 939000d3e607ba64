"""Who is calling: every RPC of every service is admitted (or refused) by one interceptor.

A service states, for each of its methods, which kinds of caller may make the call (a
``Rule``); ``AuthInterceptor`` reads the bearer credential from the metadata, resolves it with
an ``Authenticator`` and either refuses the call (UNAUTHENTICATED: no or bad credential;
PERMISSION_DENIED: wrong kind or role) or runs the handler with the caller available through
``current_principal()``. A method without a rule is refused: the check fails closed. Health
checking and reflection stay open. Finer checks (whose job is this?) are the servicers'.
A server may also have a stream's credential checked again while the stream lasts
(``recheck_streams_s``, EnvHub's): a revoked key, or the job token of an attempt that ended,
then ends every stream it opened, UNAUTHENTICATED, within that time (revocation.py).
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from opentinker.auth import credential_from_metadata, parse_credential
from opentinker.errors import (
    AuthenticationError,
    ConfigError,
    OpenTinkerError,
    UnavailableError,
)
from opentinker.scheduler.v1 import identity_pb2, identity_pb2_grpc
from opentinker.services.common.grpc_server import abort, rewrap_handler
from opentinker.services.common.revocation import Revoked, until_revoked, while_not_revoked

_KIND_PB = {
    "user": identity_pb2.PRINCIPAL_KIND_USER,
    "job": identity_pb2.PRINCIPAL_KIND_JOB,
    "worker": identity_pb2.PRINCIPAL_KIND_WORKER,
}
_ROLE_PB = {"member": identity_pb2.ROLE_MEMBER, "admin": identity_pb2.ROLE_ADMIN}


@dataclass(frozen=True)
class Principal:
    """The caller a credential stands for.

    kind: "user" (an API key), "job" (a job token of one attempt) or "worker" (a worker token).
    Users have a tenant, a user id and a role ("member" or "admin"); jobs carry their tenant,
    owner, job id and attempt; a worker token may be bound to one worker id ("" = any).
    """

    kind: str
    key_prefix: str
    tenant_id: str = ""
    user_id: str = ""
    role: str = ""
    job_id: str = ""
    attempt: int = 0
    worker_id: str = ""

    @property
    def is_admin(self) -> bool:
        return self.kind == "user" and self.role == "admin"

    @property
    def tenant_scope(self) -> str | None:
        """The one tenant this caller may see, or None for an admin (every tenant)."""
        return None if self.is_admin else self.tenant_id

    def sees(self, tenant_id: str) -> bool:
        """May this caller see a resource of ``tenant_id``? (admins see every tenant)"""
        return self.is_admin or (bool(self.tenant_id) and self.tenant_id == tenant_id)

    def describe(self) -> str:
        """For error messages and logs: kind and public prefix, never the secret."""
        who = {"user": self.user_id, "job": self.job_id, "worker": self.worker_id}[self.kind]
        return f"{self.kind} {who or '*'} (key {self.key_prefix})"

    def to_proto(self) -> identity_pb2.Principal:
        return identity_pb2.Principal(
            kind=_KIND_PB[self.kind],
            key_prefix=self.key_prefix,
            tenant_id=self.tenant_id,
            user_id=self.user_id,
            role=_ROLE_PB.get(self.role, identity_pb2.ROLE_UNSPECIFIED),
            job_id=self.job_id,
            attempt=self.attempt,
            worker_id=self.worker_id,
        )

    @classmethod
    def from_proto(cls, pb: identity_pb2.Principal) -> Principal:
        kinds = {v: k for k, v in _KIND_PB.items()}
        roles = {v: k for k, v in _ROLE_PB.items()}
        if pb.kind not in kinds:
            raise AuthenticationError("the identity service returned no principal kind")
        return cls(
            kind=kinds[pb.kind],
            key_prefix=pb.key_prefix,
            tenant_id=pb.tenant_id,
            user_id=pb.user_id,
            role=roles.get(pb.role, ""),
            job_id=pb.job_id,
            attempt=pb.attempt,
            worker_id=pb.worker_id,
        )


class Authenticator(Protocol):
    async def authenticate(self, credential: str) -> Principal:
        """The principal of ``credential``; AuthenticationError when it is unknown, malformed
        or revoked, UnavailableError when the identity store cannot be reached."""


class Caller(enum.Enum):
    """Who a rule admits. USER admits members and admins; ADMIN only admins."""

    USER = "user"
    ADMIN = "admin"
    JOB = "job"
    WORKER = "worker"
    ANYONE = "anyone"  # no credential needed


Rule = frozenset[Caller]
USERS: Rule = frozenset({Caller.USER})
ADMINS: Rule = frozenset({Caller.ADMIN})
JOBS: Rule = frozenset({Caller.JOB})
WORKERS: Rule = frozenset({Caller.WORKER})
ANYONE: Rule = frozenset({Caller.ANYONE})

# Health checks and reflection are for probes and tools; they reveal nothing of a tenant.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "opentinker_principal", default=None
)


def current_principal() -> Principal:
    """The caller of the RPC being handled (set by AuthInterceptor before the handler runs)."""
    principal = _PRINCIPAL.get()
    if principal is None:
        raise RuntimeError("no principal: the method is open or the interceptor is not installed")
    return principal


def rules_for(service: ServiceDescriptor, rules: Mapping[str, Rule]) -> dict[str, Rule]:
    """Full method paths -> rules for one service; every method must have a rule."""
    methods = {m.name for m in service.methods}
    missing, unknown = methods - set(rules), set(rules) - methods
    if missing or unknown:
        raise ValueError(
            f"access rules of {service.full_name} must name each method exactly: "
            f"missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    return {f"/{service.full_name}/{name}": rule for name, rule in rules.items()}


def admits(rule: Rule, principal: Principal) -> bool:
    if Caller.ANYONE in rule:
        return True
    if principal.kind == "user":
        return Caller.USER in rule or (Caller.ADMIN in rule and principal.is_admin)
    return Caller(principal.kind) in rule


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits each call by its method's rule; see the module docstring.

    ``recheck_streams_s``: a streaming call's credential is checked again this often while the
    stream lasts, and the stream ends UNAUTHENTICATED (reason CREDENTIAL_REVOKED) once the
    authenticator refuses it (revocation.py); None = checked only when the call starts (the
    scheduler checks its own streams; a job's processes admit only a credential they hold).
    """

    def __init__(
        self,
        authenticator: Authenticator,
        rules: Mapping[str, Rule],
        *,
        recheck_streams_s: float | None = None,
    ) -> None:
        self._authenticator = authenticator
        self._rules = dict(rules)
        self._recheck_s = recheck_streams_s

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        credential = credential_from_metadata(handler_call_details.invocation_metadata)

        async def admit(context: grpc.aio.ServicerContext) -> None:
            await self._admit(method, credential, context)

        streaming = handler.request_streaming or handler.response_streaming
        if self._recheck_s is None or not streaming or not credential:
            return _gated(handler, admit)

        async def revoked() -> bool:
            try:  # UnavailableError (cannot answer now) is raised: the stream goes on
                await self._authenticator.authenticate(credential)
            except AuthenticationError:
                return True
            return False

        return _gated(handler, admit, Recheck(revoked, self._recheck_s))

    async def _admit(self, method: str, credential: str, context: grpc.aio.ServicerContext) -> None:
        rule = self._rules.get(method)
        if rule is None:
            await abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} has no access rule on this server, so nobody may call it",
                reason="NO_ACCESS_RULE",
            )
        if Caller.ANYONE in rule and not credential:
            _PRINCIPAL.set(None)
            return
        if not credential:
            await abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs a credential: pass api_key= to the client or set "
                "OPENTINKER_API_KEY (metadata `authorization: Bearer <key>`)",
                reason="NO_CREDENTIAL",
            )
        try:
            principal = await self._authenticator.authenticate(credential)
        except UnavailableError as err:
            reason = err.reason or "AUTH_UNAVAILABLE"  # e.g. STATE_LOST (scheduler/lost_state.py)
            await abort(context, grpc.StatusCode.UNAVAILABLE, err.message, reason=reason)
        except OpenTinkerError as err:
            await abort(
                context, grpc.StatusCode.UNAUTHENTICATED, err.message, reason="BAD_CREDENTIAL"
            )
        if not admits(rule, principal):
            allowed = " or ".join(sorted(c.value for c in rule))
            await abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} is for callers of kind {allowed}; you called as {principal.describe()}",
                reason="WRONG_CALLER",
            )
        _PRINCIPAL.set(principal)


@dataclass(frozen=True)
class Recheck:
    """Check the call's credential again every ``every_s`` while it lasts (revocation.py)."""

    revoked: Revoked
    every_s: float


def _gated(
    handler: Any, admit: Callable[[Any], Awaitable[None]], recheck: Recheck | None = None
) -> Any:
    """The same handler, with ``admit(context)`` awaited before the behaviour runs, and with
    ``recheck`` the call ended UNAUTHENTICATED once its credential is revoked."""

    def coroutine(inner: Callable[..., Any]) -> Callable[..., Any]:
        async def behaviour(request_or_iterator: Any, context: Any) -> Any:
            await admit(context)
            if recheck is None:
                return await inner(request_or_iterator, context)
            try:
                return await until_revoked(
                    inner(request_or_iterator, context), recheck.revoked, every_s=recheck.every_s
                )
            except AuthenticationError as err:
                await _end_revoked(context, err)

        return behaviour

    def generator(inner: Callable[..., Any]) -> Callable[..., Any]:
        async def behaviour(request_or_iterator: Any, context: Any) -> Any:
            await admit(context)
            responses = inner(request_or_iterator, context)
            if recheck is None:
                async for response in responses:
                    yield response
                return
            try:
                async for response in while_not_revoked(
                    responses, recheck.revoked, every_s=recheck.every_s
                ):
                    yield response
            except AuthenticationError as err:
                await _end_revoked(context, err)

        return behaviour

    return rewrap_handler(handler, coroutine=coroutine, generator=generator)


async def _end_revoked(context: grpc.aio.ServicerContext, err: AuthenticationError) -> NoReturn:
    await abort(
        context, grpc.StatusCode.UNAUTHENTICATED, err.message, reason=err.reason or "BAD_CREDENTIAL"
    )


class OwnCredentialAuthenticator:
    """For a job's own processes (trainer, rollout): admits exactly the credential the process
    itself holds — the attempt's job token from the launch file (or, for a rollout started by
    hand, the key it was given) — checked locally, in constant time."""

    def __init__(self, credential: str, *, job_id: str = "", attempt: int = 0) -> None:
        parsed = parse_credential(credential)
        if parsed is None:
            raise ConfigError(
                "this process has no well-formed credential (otj_… from the launch file, or "
                "an API key); it would admit nobody",
                reason="NO_CREDENTIAL",
            )
        self._credential = credential
        self._principal = Principal(
            kind=parsed[0], key_prefix=parsed[1], job_id=job_id, attempt=attempt
        )

    async def authenticate(self, credential: str) -> Principal:
        if not hmac.compare_digest(credential.encode(), self._credential.encode()):
            raise AuthenticationError(
                f"this process serves only its own job ({self._principal.describe()}); "
                "the credential is not the one it was launched with"
            )
        return self._principal


class IdentityServiceAuthenticator:
    """For services beside the scheduler (EnvHub): asks the scheduler's IdentityService.

    Every call asks, so a revoked key fails at once. Only while the scheduler cannot answer
    (restarting, or its Redis away) does a credential that it accepted within
    ``outage_grace_s`` keep working: running jobs ride out a scheduler restart; unknown
    credentials are refused (UNAVAILABLE) until it is back.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        address: str,
        timeout_s: float = 5.0,
        outage_grace_s: float = 300.0,
    ) -> None:
        self._stub = identity_pb2_grpc.IdentityServiceStub(channel)
        self._address = address
        self._timeout_s = timeout_s
        self._outage_grace_s = outage_grace_s
        self._accepted: dict[str, tuple[Principal, float]] = {}  # sha256(credential) -> when

    async def authenticate(self, credential: str) -> Principal:
        request = identity_pb2.AuthenticateRequest(credential=credential)
        key = hashlib.sha256(credential.encode()).hexdigest()
        try:
            reply = await self._stub.Authenticate(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                self._accepted.pop(key, None)
                raise AuthenticationError(err.details() or "bad credential") from None
            known = self._accepted.get(key)
            if known is not None and time.monotonic() - known[1] <= self._outage_grace_s:
                return known[0]
            raise UnavailableError(
                f"cannot check credentials: the scheduler's IdentityService at {self._address} "
                f"answered {err.code().name}: {err.details()}",
                code=err.code().name,
            ) from None
        principal = Principal.from_proto(reply.principal)
        now = time.monotonic()
        if len(self._accepted) >= 4096:  # forget what is past its grace (job tokens pile up)
            cutoff = now - self._outage_grace_s
            self._accepted = {k: v for k, v in self._accepted.items() if v[1] >= cutoff}
        self._accepted[key] = (principal, now)
        return principal


async def require_job(context: grpc.aio.ServicerContext, job_id: str, attempt: int = 0) -> None:
    """Refuse (PERMISSION_DENIED) unless the caller is the job token of ``job_id`` (and of
    ``attempt`` when it is given)."""
    p = current_principal()
    if p.kind != "job" or p.job_id != job_id or (attempt and attempt != p.attempt):
        await abort(
            context,
            grpc.StatusCode.PERMISSION_DENIED,
            f"only job {job_id}'s own processes may do this; you called as {p.describe()}",
            reason="NOT_THIS_JOB",
        )
