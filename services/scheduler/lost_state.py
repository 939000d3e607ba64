"""Redis lost the scheduler's state: noticed, said to every caller, until an operator acts.

The scheduler's jobs, leases, users and keys live in Redis only. A Redis that restarts without
its data (persistence off, a deleted volume) is empty, and a scheduler serving from it would
answer every caller "unknown credential" and forget every running job without a word. So:

- At start-up the scheduler writes a marker (``ot:instance``, a random id) into a Redis that
  has none; with ``bootstrap_dir`` set it also records that id there (``redis-instance.id``),
  beside the bootstrap credentials, so a scheduler started again on an emptied Redis knows it.
- ``watch_marker`` reads the marker every ``instance_check_interval_s``. Once it is gone (or
  replaced) the state is *lost*: health answers NOT_SERVING, every RPC UNAVAILABLE with
  ``lost_state_message()`` (reason ``STATE_LOST``), the scheduler's loop pauses and each
  connected worker is told to close its stream. Workers keep their jobs running meanwhile
  (services/worker/agent.py): nothing has re-queued them. Between two checks, a credential
  found unknown (CheckedAuthenticator) or revoked (the scheduler's re-check of a worker's key)
  reads the marker at once (``InstanceState.confirm``) before anyone is refused or stopped.
- The operator either restores Redis's data from backup (the marker comes back, the same id:
  the scheduler serves again and workers re-announce their jobs) or accepts the loss and
  re-bootstraps with ``python -m opentinker.services.scheduler.rebootstrap --redis-url URL``,
  which writes a new marker into the empty Redis; the scheduler then makes its bootstrap
  credentials again and serves an empty deployment (workers' old jobs are stopped as unknown).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import redis.asyncio as aioredis
import structlog
from grpc_health.v1 import health, health_pb2

from opentinker.errors import STATE_LOST_REASON, AuthenticationError, UnavailableError
from opentinker.services.common.auth import Authenticator, Principal
from opentinker.services.common.grpc_server import ServiceInterceptor, abort, rewrap_handler
from opentinker.services.common.launch import write_atomic
from opentinker.services.scheduler.redis_text import as_text
from opentinker.services.scheduler.store_outage import STORE_ERRORS

log = structlog.get_logger(__name__)

MARKER_KEY = "ot:instance"
MARKER_FILE = "redis-instance.id"  # in bootstrap_dir
REASON = STATE_LOST_REASON
REBOOTSTRAP_COMMAND = "python -m opentinker.services.scheduler.rebootstrap --redis-url <URL>"


def lost_state_message() -> str:
    return (
        f"the scheduler's Redis state was lost (its marker {MARKER_KEY} is gone: Redis "
        "restarted without its data?); jobs, leases, users and keys are unknown until an "
        "operator acts. Operator: restore Redis's data (appendonlydir/, dump.rdb) from backup "
        f"and restart Redis, or accept the loss and re-bootstrap with `{REBOOTSTRAP_COMMAND}`. "
        "Running jobs are kept by their workers meanwhile; retry later"
    )


async def read_marker(redis: aioredis.Redis) -> str | None:
    raw = await redis.get(MARKER_KEY)
    return as_text(raw) if raw is not None else None


async def write_new_marker(redis: aioredis.Redis) -> str | None:
    """A new marker in a Redis that has none (the operator's re-bootstrap); None, and nothing
    written, when Redis already holds one."""
    marker = f"ot-{secrets.token_hex(8)}"
    return marker if await redis.set(MARKER_KEY, marker, nx=True) else None


async def claim_marker(redis: aioredis.Redis, bootstrap_dir: Path | None) -> str | None:
    """This deployment's marker, written now into a Redis that has none; None when the state
    was lost before this start (``bootstrap_dir`` records a marker, Redis holds none)."""
    record = _record_path(bootstrap_dir)
    marker = await read_marker(redis)
    if marker is None:
        if record is not None and record.exists():
            log.error(
                "redis_state_lost_at_start",
                recorded=record.read_text().strip(),
                record=str(record),
                fix=REBOOTSTRAP_COMMAND,
            )
            return None
        await write_new_marker(redis)
        marker = await read_marker(redis)
        assert marker is not None, "set just above (or by a scheduler starting beside us)"
        log.info("instance_marker_written", marker=marker)
    _record(record, marker)
    return marker


def _record_path(bootstrap_dir: Path | None) -> Path | None:
    return bootstrap_dir / MARKER_FILE if bootstrap_dir is not None else None


def _record(record: Path | None, marker: str) -> None:
    if record is not None:
        write_atomic(record, marker + "\n", mode=0o600)


Listener = Callable[[bool], Awaitable[None]]


class InstanceState:
    """Whether Redis still holds this deployment's state. ``lost`` while its marker is gone;
    each listener is called with ``lost`` at every change (in the order they were added)."""

    def __init__(
        self, redis: aioredis.Redis, marker: str | None, *, bootstrap_dir: Path | None = None
    ) -> None:
        self._redis = redis
        self.marker = marker
        self.bootstrap_dir = bootstrap_dir
        record = _record_path(bootstrap_dir)
        recorded = record.read_text().strip() if record and record.exists() else None
        # The marker this scheduler served last: one that comes back is a restore.
        self.last_served = marker or recorded
        self._listeners: list[Listener] = []

    @property
    def lost(self) -> bool:
        return self.marker is None

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def read(self) -> str | None:
        """The marker Redis holds now."""
        return await read_marker(self._redis)

    async def confirm(self) -> bool:
        """True when Redis holds our marker, read now. When it does not, the state is lost
        from now on, without waiting for the watch: a caller about to act on a missing record
        (an unknown key) asks this first. Redis errors propagate (store_outage.py's case)."""
        if self.lost:
            return False
        found = await self.read()
        if found == self.marker:
            return True
        log.error("redis_state_lost", marker=self.marker, found=found)
        await self.changed(None)
        return False

    async def changed(self, marker: str | None) -> None:
        was_lost = self.lost
        self.marker = marker
        if marker is not None:
            self.last_served = marker
            _record(_record_path(self.bootstrap_dir), marker)
        if self.lost != was_lost:
            for listener in self._listeners:
                await listener(self.lost)


async def watch_marker(
    state: InstanceState,
    *,
    interval_s: float,
    on_rebootstrap: Callable[[], Awaitable[None]],
) -> None:
    """Forever: notice the marker vanish (lost) and come back (restored: the same id) or be
    replaced (re-bootstrapped: ``on_rebootstrap`` runs before serving again). A Redis that is
    away is store_outage.py's case, not a loss: the check waits for it."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            if await state.confirm():
                continue
            found = await state.read()
            if found is not None:
                restored = found == state.last_served
                if not restored:
                    await on_rebootstrap()
                log.warning("redis_state_back", marker=found, restored=restored)
                await state.changed(found)
        except STORE_ERRORS:
            continue
        except Exception:  # the watch must go on: log it and check again
            log.exception("instance_marker_check_failed")


class CheckedAuthenticator:
    """``identity``'s authenticate, except that a credential unknown because Redis lost the
    state (checked at once, not at the next watch) is UNAVAILABLE saying so, not
    UNAUTHENTICATED: the caller's key may be fine, and comes back with a restore."""

    def __init__(self, identity: Authenticator, state: InstanceState) -> None:
        self._identity = identity
        self._state = state

    async def authenticate(self, credential: str) -> Principal:
        try:
            return await self._identity.authenticate(credential)
        except AuthenticationError:
            if not await self._state.confirm():
                raise UnavailableError(lost_state_message(), reason=REASON) from None
            raise


async def set_health(
    servicer: health.aio.HealthServicer, names: list[str], *, serving: bool
) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ["", *names]:
        await servicer.set(name, status)


class LostStateInterceptor(ServiceInterceptor):
    """While ``state`` is lost, every call of ``services`` ends UNAVAILABLE saying so, before
    its credential is checked (it would be "unknown": the keys were in the lost state)."""

    def __init__(self, state: InstanceState, *services: str) -> None:
        super().__init__(*services)
        self._state = state

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        state = self._state

        def coroutine(behavior: Callable[..., Awaitable[object]]) -> Callable[..., object]:
            async def refused(request: object, context: grpc.aio.ServicerContext) -> object:
                if state.lost:
                    await _refuse(context)
                return await behavior(request, context)

            return refused

        def generator(behavior: Callable[..., object]) -> Callable[..., object]:
            async def refused(request: object, context: grpc.aio.ServicerContext):  # noqa: ANN202 - an async generator of the handler's responses
                if state.lost:
                    await _refuse(context)
                async for response in behavior(request, context):  # type: ignore[attr-defined]  # an async generator behaviour
                    yield response

            return refused

        return rewrap_handler(handler, coroutine=coroutine, generator=generator)


async def _refuse(context: grpc.aio.ServicerContext) -> None:
    await abort(context, grpc.StatusCode.UNAVAILABLE, lost_state_message(), reason=REASON)
