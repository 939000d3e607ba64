"""Build the scheduler's gRPC server, alone (create_server) or with its Redis stores and loop
(running_scheduler, used by __main__, the single-node launcher and tests)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis
import structlog

from opentinker.scheduler.v1 import (
    identity_pb2,
    identity_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from opentinker.services.common.auth import AuthInterceptor
from opentinker.services.common.grpc_server import create_aio_server, mark_serving
from opentinker.services.scheduler import admin_servicer, model_servicer, servicer
from opentinker.services.scheduler.lost_state import (
    CheckedAuthenticator,
    InstanceState,
    LostStateInterceptor,
    claim_marker,
    lost_state_message,
    set_health,
    watch_marker,
)
from opentinker.services.scheduler.scheduler import Scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.scheduler.store_outage import StoreOutageInterceptor
from opentinker.services.scheduler.stores import Stores, connect_redis, redis_stores
from opentinker.services.scheduler.tenants.bootstrap import ensure_bootstrap_credentials
from opentinker.services.scheduler.tenants.credentials import load_or_create_secret
from opentinker.services.scheduler.tenants.identity import IdentityStore, RedisIdentityStore

log = structlog.get_logger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
SERVICE_NAMES = [
    SERVICE_NAME,
    identity_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    identity_pb2.DESCRIPTOR.services_by_name["IdentityService"].full_name,
    models_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
]
REDIS_SECRET_KEY = "ot:id:server-secret"


async def create_server(
    settings: SchedulerSettings,
    scheduler: Scheduler,
    identity: IdentityStore,
    state: InstanceState | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A started server on settings.host:settings.port (0 = any free port) serving
    ``scheduler``, its model catalog and the identity services, every call checked against
    ``identity``, marked SERVING; returns (server, bound_port). The caller owns
    ``scheduler.start()`` / ``close()``.
    While Redis is away every call answers UNAVAILABLE (store_outage.py); while ``state`` is
    lost, too, and health says NOT_SERVING (lost_state.py)."""
    rules = {
        **servicer.ACCESS_RULES,
        **admin_servicer.ACCESS_RULES,
        **model_servicer.ACCESS_RULES,
    }
    auth = AuthInterceptor(
        identity if state is None else CheckedAuthenticator(identity, state), rules
    )
    server, port, health = create_aio_server(
        SERVICE_NAMES,
        host=settings.host,
        port=settings.port,
        interceptors=[
            *([LostStateInterceptor(state, *SERVICE_NAMES)] if state is not None else []),
            StoreOutageInterceptor(*SERVICE_NAMES),
            auth,
        ],
    )
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(
        servicer.SchedulerServicer(scheduler), server
    )
    identity_pb2_grpc.add_AdminServiceServicer_to_server(
        admin_servicer.AdminServicer(identity), server
    )
    identity_pb2_grpc.add_IdentityServiceServicer_to_server(
        admin_servicer.IdentityServicer(identity), server
    )
    models_pb2_grpc.add_ModelServiceServicer_to_server(
        model_servicer.ModelServicer(scheduler.models), server
    )
    await server.start()
    await mark_serving(health, SERVICE_NAMES)
    if state is not None:
        await set_health(health, SERVICE_NAMES, serving=not state.lost)

        async def follow(lost: bool) -> None:
            await set_health(health, SERVICE_NAMES, serving=not lost)

        state.listen(follow)
    return server, port


async def server_secret(settings: SchedulerSettings, redis: aioredis.Redis) -> bytes:
    """The HMAC key of stored credentials: from settings.auth_secret_file, else kept in Redis."""
    if settings.auth_secret_file is not None:
        return load_or_create_secret(settings.auth_secret_file)
    await redis.set(REDIS_SECRET_KEY, secrets.token_hex(32), nx=True)
    log.warning(
        "auth_secret_in_redis",
        hint="set OPENTINKER_AUTH_SECRET_FILE so that credential digests and their key live apart",
    )
    secret = await redis.get(REDIS_SECRET_KEY)
    assert isinstance(secret, bytes), "set just above; connect_redis's client returns bytes"
    return secret


@dataclass(frozen=True)
class RunningScheduler:
    scheduler: Scheduler
    stores: Stores
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@asynccontextmanager
async def running_scheduler(
    settings: SchedulerSettings, *, stop_grace_s: float = 5.0
) -> AsyncIterator[RunningScheduler]:
    """Connect to Redis (failing fast if it is not there), start the loop and the server; on
    exit tell workers the scheduler is closing, stop serving and disconnect. Every shutdown
    step is bounded, so a stuck peer cannot hold the process."""
    redis = connect_redis(settings.redis_url)
    try:
        await redis.ping()
        secret = await server_secret(settings, redis)
        stores = redis_stores(
            redis,
            lease_ttl_s=settings.lease_ttl_s,
            server_secret=secret,
            event_max_progress=settings.event_max_progress,
        )
        state = InstanceState(
            redis,
            await claim_marker(redis, settings.bootstrap_dir),
            bootstrap_dir=settings.bootstrap_dir,
        )

        async def bootstrap() -> None:
            if settings.auth_secret_file is None:  # a re-bootstrapped Redis needs it again
                await redis.set(REDIS_SECRET_KEY, secret, nx=True)
            if settings.bootstrap_dir is not None:
                assert isinstance(stores.identity, RedisIdentityStore)
                await ensure_bootstrap_credentials(
                    stores.identity, settings.bootstrap_dir, settings.worker_token_dir
                )

        if not state.lost:
            await bootstrap()
        scheduler = Scheduler(
            stores,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            lease_ttl_s=settings.lease_ttl_s,
            max_attempts=settings.max_attempts,
            unschedulable_after_s=settings.unschedulable_after_s,
            reconnect_grace_s=settings.reconnect_grace_s,
            drain_timeout_s=settings.drain_timeout_s,
            state_intact=state.confirm,
            shared_lora_sessions=settings.shared_lora_sessions,
        )
        if state.lost:
            scheduler.suspend(lost_state_message())

        async def follow(lost: bool) -> None:
            if lost:
                scheduler.suspend(lost_state_message())
            else:
                scheduler.resume()

        state.listen(follow)
        await scheduler.start()
        server, port = await create_server(settings, scheduler, stores.identity, state)
        watch = asyncio.create_task(
            watch_marker(
                state,
                interval_s=settings.instance_check_interval_s,
                on_rebootstrap=bootstrap,
            ),
            name="instance-marker-watch",
        )
        try:
            yield RunningScheduler(scheduler, stores, port)
        finally:
            watch.cancel()
            await scheduler.close()
            await _bounded(server.stop(grace=stop_grace_s), stop_grace_s + 5, "grpc_server_stop")
            log.info("scheduler_stopped", port=port)
    finally:
        await _bounded(redis.aclose(), 5, "redis_close")


async def _bounded(step: Awaitable[object], timeout_s: float, name: str) -> None:
    try:
        await asyncio.wait_for(step, timeout_s)
    except Exception as err:  # shutting down anyway: note it and go on
        log.warning("shutdown_step_failed", step=name, error=repr(err))
