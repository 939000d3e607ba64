"""Dispatch rounds against a worker whose stream changes under them: the real Scheduler on a
real Redis, driven directly (its methods, as the gRPC servicer calls them), so that a
reconnect can be placed exactly between two of a round's awaits.
"""

from __future__ import annotations

import asyncio

import pytest
from scheduler_helpers import ALLOCATING, QUEUED, spec

from opentinker.services.common.auth import Principal
from opentinker.services.scheduler.placement.worker_session import (
    DeviceOffer,
    LaunchCommand,
    StopCommand,
)
from opentinker.services.scheduler.scheduler import Scheduler
from opentinker.services.scheduler.stores import connect_redis, redis_stores

pytestmark = pytest.mark.integration

OWNER = Principal(kind="user", key_prefix="k", tenant_id="acme", user_id="u", role="member")


def test_a_worker_that_reconnects_during_a_round_gets_its_job_launched_on_its_new_stream(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The round listed the worker's session, then awaited the lease while the worker's stream
    dropped and it registered again. The lease was taken and the launch sent on the old
    stream (dropped), while the new stream renewed the lease at every heartbeat: the job
    stayed ALLOCATING for good with its device held. Now the lease is given back and the
    next round launches the job on the new stream."""

    async def main() -> None:
        client = connect_redis(redis_url)
        await client.flushdb()
        stores = redis_stores(client, lease_ttl_s=1.0, server_secret=b"t" * 32)
        scheduler = Scheduler(stores, heartbeat_interval_s=0.2, lease_ttl_s=1.0)
        devices = [DeviceOffer("w1/cuda:0", "cuda")]
        old = await scheduler.connect_worker("w1", "h1", devices)
        job = await scheduler.submit(spec("raced"), owner=OWNER)
        ledger = stores.ledger
        acquire = ledger.acquire
        new = []

        async def acquire_while_the_worker_reconnects(worker_id: str, job_id: str, n: int):
            if not new:
                await scheduler.disconnect_worker(old, "stream dropped")
                new.append(await scheduler.connect_worker("w1", "h1", devices))
            return await acquire(worker_id, job_id, n)

        monkeypatch.setattr(ledger, "acquire", acquire_while_the_worker_reconnects)
        assert await scheduler.dispatch() == 0  # the lease taken for the old stream: given back
        assert (await stores.jobs.get(job.job_id)).state == QUEUED
        assert await ledger.leases("w1") == []
        assert await scheduler.dispatch() == 1  # the next round, on the new stream
        placed = await stores.jobs.get(job.job_id)
        assert placed.state == ALLOCATING
        command = new[0].outbox.get_nowait()
        assert isinstance(command, LaunchCommand) and command.job.job_id == job.job_id
        await client.aclose()

    asyncio.run(main())


def test_an_active_job_whose_lease_is_gone_is_stopped_and_re_queued(redis_url: str) -> None:
    """A scheduler that died between releasing a lease and re-queueing its job (every path
    writes the ledger first), or a placement whose commit reply was lost (its undo released
    the lease of a committed placement), left the job RUNNING or ALLOCATING with no lease:
    nothing ever looked at it again. Now the sweep stops its attempt and re-queues it, once
    two sweeps have seen it so (an exit releases its lease just before the job ends)."""

    async def main() -> None:
        client = connect_redis(redis_url)
        await client.flushdb()
        stores = redis_stores(client, lease_ttl_s=0.5, server_secret=b"t" * 32)
        scheduler = Scheduler(stores, heartbeat_interval_s=0.1, lease_ttl_s=0.5)
        session = await scheduler.connect_worker("w1", "h1", [DeviceOffer("w1/cuda:0", "cuda")])
        job = await scheduler.submit(spec("lost"), owner=OWNER)
        assert await scheduler.dispatch() == 1
        first = session.outbox.get_nowait()
        assert isinstance(first, LaunchCommand)
        await stores.ledger.release(first.lease_id)  # the crash window: lease gone, job active
        await scheduler.start()
        try:
            again = None
            for _ in range(100):  # the worker heartbeats; sweeps every 1 s (2 lease TTLs)
                scheduler.worker_seen(session)
                await asyncio.sleep(0.1)
                again = await stores.jobs.get(job.job_id)
                if again.attempt == 2:
                    break
            assert again is not None and again.attempt == 2 and again.state == ALLOCATING
            sent = [session.outbox.get_nowait() for _ in range(session.outbox.qsize())]
            stops = [c for c in sent if isinstance(c, StopCommand)]
            assert [(s.job_id, s.attempt) for s in stops] == [(job.job_id, 1)], sent
            assert any(isinstance(c, LaunchCommand) and c.job.attempt == 2 for c in sent)
        finally:
            await scheduler.close()
            await client.aclose()

    asyncio.run(main())
