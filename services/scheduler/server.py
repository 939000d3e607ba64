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
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from opentinker.services.common.auth import AuthInterceptor
from opentinker.services.common.grpc_server import create_aio_server, mark_serving
from opentinker.services.scheduler import admin_servicer, servicer
from opentinker.services.scheduler.bootstrap import ensure_bootstrap_credentials
from opentinker.services.scheduler.credentials import load_or_create_secret
from opentinker.services.scheduler.identity import IdentityStore, RedisIdentityStore
from opentinker.services.scheduler.scheduler import Scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.scheduler.store_outage import StoreOutageInterceptor
from opentinker.services.scheduler.stores import Stores, connect_redis, redis_stores

log = structlog.get_logger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
SERVICE_NAMES = [
    SERVICE_NAME,
    identity_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    identity_pb2.DESCRIPTOR.services_by_name["IdentityService"].full_name,
]
REDIS_SECRET_KEY = "ot:id:server-secret"


async def create_server(
    settings: SchedulerSettings, scheduler: Scheduler, identity: IdentityStore
) -> tuple[grpc.aio.Server, int]:
    """A started server on settings.host:settings.port (0 = any free port) serving
    ``scheduler`` and the identity services, every call checked against ``identity``, marked
    SERVING; returns (server, bound_port). The caller owns ``scheduler.start()`` / ``close()``.
    While Redis is away every call answers UNAVAILABLE (store_outage.py)."""
    auth = AuthInterceptor(identity, {**servicer.ACCESS_RULES, **admin_servicer.ACCESS_RULES})
    server, port, health = create_aio_server(
        SERVICE_NAMES,
        host=settings.host,
        port=settings.port,
        interceptors=[StoreOutageInterceptor(*SERVICE_NAMES), auth],
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
    await server.start()
    await mark_serving(health, SERVICE_NAMES)
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
        stores = redis_stores(
            redis,
            lease_ttl_s=settings.lease_ttl_s,
            server_secret=await server_secret(settings, redis),
            event_max_progress=settings.event_max_progress,
        )
        if settings.bootstrap_dir is not None:
            assert isinstance(stores.identity, RedisIdentityStore)
            await ensure_bootstrap_credentials(stores.identity, settings.bootstrap_dir)
        scheduler = Scheduler(
            stores,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            lease_ttl_s=settings.lease_ttl_s,
            max_attempts=settings.max_attempts,
            unschedulable_after_s=settings.unschedulable_after_s,
            reconnect_grace_s=settings.reconnect_grace_s,
            drain_timeout_s=settings.drain_timeout_s,
        )
        await scheduler.start()
        server, port = await create_server(settings, scheduler, stores.identity)
        try:
            yield RunningScheduler(scheduler, stores, port)
        finally:
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
