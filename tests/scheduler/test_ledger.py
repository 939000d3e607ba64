"""Contract tests of the LeaseLedger, run against every implementation (Redis today)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import redis.asyncio as aioredis

from opentinker.services.scheduler.leases import lease_scripts
from opentinker.services.scheduler.leases.lease_ledger import LeaseLedger, RedisLeaseLedger

pytestmark = pytest.mark.integration


def redis_ledgers(redis_url: str) -> Callable[[float], AsyncIterator[LeaseLedger]]:
    @asynccontextmanager
    async def make(ttl_s: float) -> AsyncIterator[LeaseLedger]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            yield RedisLeaseLedger(client, lease_ttl_s=ttl_s)
        finally:
            await client.aclose()

    return make


@pytest.fixture(params=["redis"])
def make_ledger(request: pytest.FixtureRequest, redis_url: str):
    """An async context manager factory: ``async with make_ledger(ttl_s) as ledger``."""
    return {"redis": redis_ledgers}[request.param](redis_url)


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro_fn())


def test_concurrent_acquire_of_one_device_has_exactly_one_winner(make_ledger) -> None:
    async def main() -> None:
        # Two separate clients (two connections), as two schedulers would have.
        async with make_ledger(10.0) as a, make_ledger(10.0) as b:
            await a.register_worker("w1", ["node/cuda:0"])
            results = await asyncio.gather(
                *[(a if i % 2 else b).acquire("w1", f"job-{i}", 1) for i in range(20)]
            )
            winners = [lease for lease in results if lease is not None]
            assert len(winners) == 1
            assert winners[0].device_ids == ("node/cuda:0",)
            assert await a.free_devices("w1") == []

    run(main)


def test_acquire_takes_n_devices_or_none(make_ledger) -> None:
    async def main() -> None:
        async with make_ledger(10.0) as ledger:
            await ledger.register_worker("w1", ["n/cuda:0", "n/cuda:1", "n/cuda:2"])
            first = await ledger.acquire("w1", "job-a", 2)
            assert first is not None and first.device_ids == ("n/cuda:0", "n/cuda:1")
            # One device left: asking for two takes none.
            assert await ledger.acquire("w1", "job-b", 2) is None
            assert await ledger.free_devices("w1") == ["n/cuda:2"]
            # A worker that offers nothing gives nothing.
            assert await ledger.acquire("w-unknown", "job-c", 1) is None
            with pytest.raises(ValueError):
                await ledger.acquire("w1", "job-d", 0)

    run(main)


def test_lease_lapses_without_heartbeats_and_frees_its_device(make_ledger) -> None:
    async def main() -> None:
        async with make_ledger(0.3) as ledger:
            await ledger.register_worker("w1", ["n/cpu:0"])
            lease = await ledger.acquire("w1", "job-a", 1)
            assert lease is not None
            assert await ledger.is_live(lease.lease_id)
            assert await ledger.lapsed() == []
            await asyncio.sleep(0.5)
            assert not await ledger.is_live(lease.lease_id)
            assert await ledger.free_devices("w1") == ["n/cpu:0"]
            assert [lapsed.job_id for lapsed in await ledger.lapsed()] == ["job-a"]
            # A lapsed lease is not revived by a late heartbeat.
            assert await ledger.renew("w1") == 0
            # Its device can be leased again; releasing the lapsed lease leaves the new one.
            again = await ledger.acquire("w1", "job-b", 1)
            assert again is not None
            assert await ledger.release(lease.lease_id)
            assert await ledger.is_live(again.lease_id)
            assert await ledger.lapsed() == []

    run(main)


def test_renew_keeps_a_lease_alive_past_its_ttl(make_ledger) -> None:
    async def main() -> None:
        async with make_ledger(0.3) as ledger:
            await ledger.register_worker("w1", ["n/cpu:0"])
            lease = await ledger.acquire("w1", "job-a", 1)
            assert lease is not None
            for _ in range(5):  # 0.5 s in all, well past the 0.3 s TTL
                await asyncio.sleep(0.1)
                assert await ledger.renew("w1") == 1
            assert await ledger.is_live(lease.lease_id)
            assert await ledger.free_devices("w1") == []

    run(main)


def test_release_frees_devices_and_is_idempotent(make_ledger) -> None:
    async def main() -> None:
        async with make_ledger(10.0) as ledger:
            await ledger.register_worker("w1", ["n/cpu:0", "n/cpu:1"])
            lease = await ledger.acquire("w1", "job-a", 2)
            assert lease is not None
            assert [found.lease_id for found in await ledger.leases("w1")] == [lease.lease_id]
            got = await ledger.get(lease.lease_id)
            assert got is not None and got.job_id == "job-a" and got.worker_id == "w1"
            assert await ledger.release(lease.lease_id) is True
            assert await ledger.release(lease.lease_id) is False
            assert await ledger.get(lease.lease_id) is None
            assert await ledger.leases("w1") == []
            assert await ledger.free_devices("w1") == ["n/cpu:0", "n/cpu:1"]

    run(main)


def test_revive_holds_a_lapsed_lease_again_unless_its_devices_moved_on(make_ledger) -> None:
    async def main() -> None:
        async with make_ledger(0.3) as ledger:
            await ledger.register_worker("w1", ["n/cpu:0", "n/cpu:1"])
            lost = await ledger.acquire("w1", "job-b", 1)
            kept = await ledger.acquire("w1", "job-a", 1)
            assert lost is not None and kept is not None
            await asyncio.sleep(0.5)  # both lapse: the worker was away past the TTL
            assert {lease.job_id for lease in await ledger.lapsed()} == {"job-a", "job-b"}
            # job-b's device went to another lease meanwhile.
            taker = await ledger.acquire("w1", "job-c", 1)
            assert taker is not None and taker.device_ids == lost.device_ids
            assert not await ledger.revive(lost.lease_id, "w1", "job-b")
            # Only the lease's own worker and job revive it, and only while it is not released.
            assert not await ledger.revive(kept.lease_id, "w2", "job-a")
            assert not await ledger.revive(kept.lease_id, "w1", "job-x")
            assert not await ledger.revive("lease-unknown", "w1", "job-a")
            assert await ledger.revive(kept.lease_id, "w1", "job-a")
            assert await ledger.is_live(kept.lease_id) and await ledger.is_live(taker.lease_id)
            assert [lease.job_id for lease in await ledger.lapsed()] == ["job-b"]
            assert await ledger.renew("w1") == 2  # heartbeats keep the revived lease again
            assert await ledger.release(lost.lease_id)
            assert not await ledger.revive(lost.lease_id, "w1", "job-b")

    run(main)


def test_a_draining_lease_keeps_its_devices_until_released(make_ledger) -> None:
    async def main() -> None:
        async with make_ledger(0.4) as ledger:
            await ledger.register_worker("w1", ["n/cpu:0", "n/cpu:1"])
            lease = await ledger.acquire("w1", "job-a", 2)
            assert lease is not None and lease.drain is None
            assert await ledger.drain(lease.lease_id, 1, "cancelled")
            assert not await ledger.drain("lease-unknown", 1, "cancelled")
            [held] = await ledger.draining()
            assert held.lease_id == lease.lease_id and held.drain is not None
            assert (held.drain.attempt, held.drain.reason) == (1, "cancelled")
            # A second drain keeps the first's time and reason.
            assert await ledger.drain(lease.lease_id, 2, "again")
            again = await ledger.get(lease.lease_id)
            assert again is not None and again.drain == held.drain
            assert await ledger.free_devices("w1") == []
            assert await ledger.acquire("w1", "job-b", 1) is None
            await asyncio.sleep(0.3)
            assert await ledger.renew("w1") == 1  # its worker's heartbeats keep it
            await asyncio.sleep(0.3)
            assert await ledger.lapsed() == []
            assert await ledger.release(lease.lease_id)
            assert await ledger.draining() == []
            assert await ledger.free_devices("w1") == ["n/cpu:0", "n/cpu:1"]

    run(main)


def test_draining_a_lapsed_lease_holds_again_only_devices_no_lease_took(make_ledger) -> None:
    async def main() -> None:
        async with make_ledger(0.3) as ledger:
            await ledger.register_worker("w1", ["n/cpu:0", "n/cpu:1"])
            lapsing = await ledger.acquire("w1", "job-a", 1)
            quiet = await ledger.acquire("w1", "job-b", 1)
            assert lapsing is not None and quiet is not None
            await asyncio.sleep(0.5)  # both lapse
            taker = await ledger.acquire("w1", "job-c", 1)
            assert taker is not None and taker.device_ids == lapsing.device_ids
            assert await ledger.drain(lapsing.lease_id, 1, "lease lapsed")
            assert await ledger.is_live(taker.lease_id)  # its device stays the taker's
            # Without rehold (a lost worker's): nothing is held again.
            assert await ledger.drain(quiet.lease_id, 1, "worker lost", rehold=False)
            assert not await ledger.is_live(quiet.lease_id)
            assert await ledger.free_devices("w1") == list(quiet.device_ids)

    run(main)


def test_the_history_records_every_lease_and_proves_exclusivity(redis_url: str) -> None:
    from opentinker.services.scheduler.leases.lease_history import double_leases
    from opentinker.services.scheduler.leases.lease_ledger import LeaseEvent, RedisLeaseLedger
    from opentinker.services.scheduler.stores import connect_redis

    async def main() -> None:
        client = connect_redis(redis_url)
        ledger = RedisLeaseLedger(client, lease_ttl_s=5.0)
        await ledger.register_worker("w", ["w/0", "w/1"])
        first = await ledger.acquire("w", "job-a", 2)
        assert first is not None and await ledger.acquire("w", "job-b", 1) is None
        await ledger.release(first.lease_id)
        second = await ledger.acquire("w", "job-b", 1)
        assert second is not None
        assert await ledger.revive(second.lease_id, "w", "job-b")
        assert await ledger.drain(second.lease_id, 1, "cancelled")
        events = await ledger.history()
        assert [(e.kind, e.job_id) for e in events] == [
            ("acquire", "job-a"),
            ("release", "job-a"),
            ("acquire", "job-b"),
            ("revive", "job-b"),
            ("drain", "job-b"),
        ]
        assert events[0].device_ids == ("w/0", "w/1") and events[0].at_unix_s > 0
        assert double_leases(events) == []

        # Hand-made: a device taken while its lease was not released, a job with two leases.
        def ev(kind: str, lease: str, job: str, devices: tuple[str, ...] = ()) -> LeaseEvent:
            return LeaseEvent(kind, lease, job, "w", devices, 0.0)

        bad = [ev("acquire", "L1", "j1", ("d0",)), ev("acquire", "L2", "j1", ("d0",))]
        problems = double_leases(bad)
        assert len(problems) == 2
        assert "device d0" in problems[0] and "two attempts at once" in problems[1]
        assert double_leases([*bad[:1], ev("release", "L1", "j1"), bad[1]]) == []
        await client.aclose()

    asyncio.run(main())


@asynccontextmanager
async def one_device_ledger(redis_url: str) -> AsyncIterator[tuple[aioredis.Redis, LeaseLedger]]:
    """A fresh ledger (prefix t:ledger) whose worker w1 offers one device, and its client."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.flushdb()
        ledger = RedisLeaseLedger(client, lease_ttl_s=5.0, prefix="t:ledger")
        await ledger.register_worker("w1", ["w1/cuda:0"])
        yield client, ledger
    finally:
        await client.aclose()


def test_an_acquire_run_again_with_its_lease_id_gives_the_same_devices(redis_url: str) -> None:
    """The Redis client retries a command on a connection error, also when the error came
    after the script ran (the reply was lost): the second run found the device held by its
    own first run and refused, so the job stayed queued while that lease, its worker renewing
    it, held the device for good. Now the second run answers as the first did."""

    async def main() -> None:
        async with one_device_ledger(redis_url) as (client, ledger):
            script = client.register_script(lease_scripts.ACQUIRE)
            args = ["t:ledger", "w1", "job-a", 1, "lease-retried", 5000, "1.0", 100]
            first, again = await script(args=args), await script(args=args)
            assert first == again == [b"w1/cuda:0"]
            [lease] = await ledger.leases("w1")
            assert lease.lease_id == "lease-retried" and lease.device_ids == ("w1/cuda:0",)
            assert await ledger.acquire("w1", "job-b", 1) is None  # one lease holds it

    run(main)


def test_a_release_run_again_by_the_same_call_answers_as_it_did(redis_url: str) -> None:
    """The client's retry of a RELEASE whose reply was lost found the lease gone and said
    False: the accounted ledger then took the charge back, the lease billed 0 s. The same
    call (its call id) now gets its own answer again; another caller still gets False."""

    async def main() -> None:
        async with one_device_ledger(redis_url) as (client, ledger):
            lease = await ledger.acquire("w1", "job-a", 1)
            assert lease is not None
            script = client.register_script(lease_scripts.RELEASE)
            args = ["t:ledger", lease.lease_id, 100, "call-1"]
            assert (await script(args=args), await script(args=args)) == (1, 1)
            assert await ledger.release(lease.lease_id) is False  # another call: already gone
            assert await ledger.leases("w1") == []

    run(main)


def test_a_group_acquire_run_again_with_its_lease_ids_gives_the_same_answer(
    redis_url: str,
) -> None:
    """As a retried ACQUIRE: the second run of a spanning job's group acquire found the
    devices held by its own first run and refused, leaving those leases held for good."""

    async def main() -> None:
        async with one_device_ledger(redis_url) as (client, ledger):
            await ledger.register_worker("w2", ["w2/cuda:0"])
            script = client.register_script(lease_scripts.ACQUIRE_GROUP)
            args = ["t:ledger", "job-s", 5000, "1.0", 100, 29500, 4]
            args += ["w1", 1, "lease-g1", "w2", 1, "lease-g2"]
            first, again = await script(args=args), await script(args=args)
            assert first == again == [b"29500", b"w1/cuda:0", b"w2/cuda:0"]
            held = [lease.lease_id for w in ("w1", "w2") for lease in await ledger.leases(w)]
            assert held == ["lease-g1", "lease-g2"]

    run(main)
