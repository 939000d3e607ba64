"""Build the scheduler's gRPC server, alone (create_server) or with its Redis stores and loop
(running_scheduler, used by __main__, the single-node launcher and tests)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import structlog

from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import create_aio_server, mark_serving
from opentinker.services.scheduler.scheduler import Scheduler
from opentinker.services.scheduler.servicer import SchedulerServicer
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.scheduler.store_outage import StoreOutageInterceptor
from opentinker.services.scheduler.stores import Stores, connect_redis, redis_stores

log = structlog.get_logger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


async def create_server(
    settings: SchedulerSettings, scheduler: Scheduler
) -> tuple[grpc.aio.Server, int]:
    """A started server on settings.host:settings.port (0 = any free port) serving
    ``scheduler``, marked SERVING; returns (server, bound_port). The caller owns
    ``scheduler.start()`` / ``scheduler.close()``."""
    server, port, health = create_aio_server(
        [SERVICE_NAME],
        host=settings.host,
        port=settings.port,
        interceptors=[StoreOutageInterceptor(SERVICE_NAME)],
    )
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(scheduler), server)
    await server.start()
    await mark_serving(health, [SERVICE_NAME])
    return server, port


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
            redis, lease_ttl_s=settings.lease_ttl_s, event_max_progress=settings.event_max_progress
        )
        scheduler = Scheduler(
            stores,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            lease_ttl_s=settings.lease_ttl_s,
            reconnect_grace_s=settings.reconnect_grace_s,
        )
        await scheduler.start()
        server, port = await create_server(settings, scheduler)
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
