"""The scheduler's state, all in Redis: jobs, the queue, the lease ledger, the event log,
tenants, users and credentials, and the model catalog."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from opentinker.services.scheduler.jobs.event_log import EventLog, RedisEventLog
from opentinker.services.scheduler.jobs.job_queue import JobQueue, RedisJobQueue
from opentinker.services.scheduler.jobs.job_store import JobStore, RedisJobStore
from opentinker.services.scheduler.leases.accounted_ledger import AccountedLedger
from opentinker.services.scheduler.leases.lease_ledger import LeaseLedger, RedisLeaseLedger
from opentinker.services.scheduler.leases.usage import RedisUsageStore, UsageStore
from opentinker.services.scheduler.model_catalog import ModelCatalog, RedisModelCatalog
from opentinker.services.scheduler.tenants.identity import IdentityStore, RedisIdentityStore

# Longer than the event log's blocking reads (1 s), short enough that a dead Redis is noticed.
REDIS_SOCKET_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Stores:
    jobs: JobStore
    queue: JobQueue
    ledger: LeaseLedger
    events: EventLog
    identity: IdentityStore
    usage: UsageStore
    models: ModelCatalog


def connect_redis(url: str) -> aioredis.Redis:
    """A pooled asyncio client returning bytes (the stores decode what they read).

    After a Redis restart every pooled connection is dead; a command that meets one is retried
    on a fresh connection (a few times, briefly) instead of failing, so one restart costs the
    callers nothing once Redis is back. Only connection errors are retried (the command did not
    reach a live server), never timeouts, which may have run.
    """
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        socket_connect_timeout=5.0,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        retry=Retry(
            ExponentialBackoff(cap=0.5, base=0.05),
            retries=3,
            supported_errors=(RedisConnectionError,),
        ),
    )


def redis_stores(
    client: aioredis.Redis,
    *,
    lease_ttl_s: float,
    server_secret: bytes,
    event_max_progress: int = 10_000,
) -> Stores:
    """``server_secret`` keys the HMAC under which credentials are stored (credentials.py)."""
    queue = RedisJobQueue(client)
    jobs = RedisJobStore(client, queue_key=queue.key)
    identity = RedisIdentityStore(client, server_secret=server_secret)
    usage = RedisUsageStore(client)
    ledger = AccountedLedger(
        RedisLeaseLedger(client, lease_ttl_s=lease_ttl_s), usage=usage, jobs=jobs, identity=identity
    )
    return Stores(
        jobs=jobs,
        queue=queue,
        ledger=ledger,
        events=RedisEventLog(client, max_progress=event_max_progress),
        identity=identity,
        usage=usage,
        models=RedisModelCatalog(client),
    )
