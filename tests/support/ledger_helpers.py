"""Read a mesh's lease-ledger history and prove no job ran twice at once (tests only)."""

from __future__ import annotations

import asyncio

from opentinker.services.scheduler.leases.lease_history import double_leases
from opentinker.services.scheduler.leases.lease_ledger import LeaseEvent, RedisLeaseLedger
from opentinker.services.scheduler.stores import connect_redis


def ledger_history(redis_url: str) -> list[LeaseEvent]:
    async def read() -> list[LeaseEvent]:
        client = connect_redis(redis_url)
        try:
            return await RedisLeaseLedger(client, lease_ttl_s=10.0).history()
        finally:
            await client.aclose()

    return asyncio.run(read())


def assert_no_double_lease(redis_url: str, job_id: str, *, attempts: int) -> None:
    """The whole history is free of double leases, and ``job_id`` took exactly ``attempts``
    leases, each released before the next was taken."""
    events = ledger_history(redis_url)
    assert not double_leases(events), double_leases(events)
    acquired = [e for e in events if e.job_id == job_id and e.kind == "acquire"]
    assert len(acquired) == attempts, [(e.kind, e.lease_id) for e in events if e.job_id == job_id]
