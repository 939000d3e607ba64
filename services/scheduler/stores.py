"""The scheduler's state, all in Redis: jobs, the queue, the lease ledger, the event log, and
tenants, users and credentials."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from opentinker.services.scheduler.accounted_ledger import AccountedLedger
from opentinker.services.scheduler.event_log import EventLog, RedisEventLog
from opentinker.services.scheduler.identity import IdentityStore, RedisIdentityStore
from opentinker.services.scheduler.job_queue import JobQueue, RedisJobQueue
from opentinker.services.scheduler.job_store import JobStore, RedisJobStore
from opentinker.services.scheduler.lease_ledger import LeaseLedger, RedisLeaseLedger
from opentinker.services.scheduler.usage import RedisUsageStore, UsageStore

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


def connect_redis(url: str) -> aioredis.Redis:
    """A pooled asyncio client returning bytes (the stores decode what they read)."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        socket_connect_timeout=5.0,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
    )


def redis_stores(client: aioredis.Redis, *, lease_ttl_s: float, server_secret: bytes) -> Stores:
    """``server_secret`` keys the HMAC under which credentials are stored (credentials.py)."""
    jobs = RedisJobStore(client)
    identity = RedisIdentityStore(client, server_secret=server_secret)
    usage = RedisUsageStore(client)
    ledger = AccountedLedger(
        RedisLeaseLedger(client, lease_ttl_s=lease_ttl_s), usage=usage, jobs=jobs, identity=identity
    )
    return Stores(
        jobs=jobs,
        queue=RedisJobQueue(client),
        ledger=ledger,
        events=RedisEventLog(client),
        identity=identity,
        usage=usage,
    )
