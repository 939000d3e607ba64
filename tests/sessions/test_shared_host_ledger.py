"""The ledger's shares of a shared LoRA host: sessions of one host hold one device together,
up to its slots; the device is freed with the last share; each share is charged its part of the
device-seconds; a host whose device lapses lapses all its shares; the history shows no double
lease."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from opentinker.services.scheduler.leases.lease_history import double_leases
from opentinker.services.scheduler.leases.lease_ledger import RedisLeaseLedger

pytestmark = pytest.mark.integration


def test_shares_hold_one_device_up_to_the_slots_and_free_it_with_the_last(
    redis_url: str,
) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            ledger = RedisLeaseLedger(client, lease_ttl_s=10.0)
            await ledger.register_worker("w1", ["n/cpu:0", "n/cpu:1"])
            a = await ledger.acquire_share("w1", "job-a", "host-1", 2)
            b = await ledger.acquire_share("w1", "job-b", "host-1", 2)
            assert a is not None and b is not None
            assert a.device_ids == b.device_ids == ("n/cpu:0",)
            assert a.host_id == "host-1" and a.share == 0.5
            # Full: a third share is refused; the other device is still free for a whole lease
            assert await ledger.acquire_share("w1", "job-c", "host-1", 2) is None
            assert await ledger.free_devices("w1") == ["n/cpu:1"]
            assert await ledger.is_live(a.lease_id) and await ledger.is_live(b.lease_id)
            assert await ledger.renew("w1") == 2
            # A host on another worker's id is not joined from here
            await ledger.register_worker("w2", ["m/cpu:0"])
            assert await ledger.acquire_share("w2", "job-d", "host-1", 2) is None
            assert await ledger.release(a.lease_id)
            assert await ledger.is_live(b.lease_id), "the host's device stays held for b"
            assert await ledger.free_devices("w1") == ["n/cpu:1"]
            c = await ledger.acquire_share("w1", "job-c", "host-1", 2)  # a's slot again
            assert c is not None and c.device_ids == ("n/cpu:0",)
            assert await ledger.release(b.lease_id) and await ledger.release(c.lease_id)
            assert await ledger.free_devices("w1") == ["n/cpu:0", "n/cpu:1"]
            assert not double_leases(await ledger.history())
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_host_whose_device_lapses_lapses_every_share(redis_url: str) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            ledger = RedisLeaseLedger(client, lease_ttl_s=0.3)
            await ledger.register_worker("w1", ["n/cpu:0"])
            a = await ledger.acquire_share("w1", "job-a", "host-1", 4)
            b = await ledger.acquire_share("w1", "job-b", "host-1", 4)
            assert a is not None and b is not None
            await asyncio.sleep(0.5)  # no heartbeat renews the host's device
            assert {lease.lease_id for lease in await ledger.lapsed()} == {a.lease_id, b.lease_id}
            # Not joinable once lapsed: a new session waits for the old shares' release
            assert await ledger.acquire_share("w1", "job-c", "host-1", 4) is None
            # A reconnecting worker still running them revives them under the host's key
            assert await ledger.revive(a.lease_id, "w1", "job-a")
            assert await ledger.is_live(b.lease_id)
            await ledger.release(a.lease_id)
            await ledger.release(b.lease_id)
            assert await ledger.free_devices("w1") == ["n/cpu:0"]
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_share_is_charged_its_part_of_the_device(redis_url: str) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            ledger = RedisLeaseLedger(client, lease_ttl_s=10.0)
            await ledger.register_worker("w1", ["n/cpu:0"])
            share = await ledger.acquire_share("w1", "job-a", "host-1", 4)
            assert share is not None
            assert share.share == 0.25  # charged 1/4 of each second it is held
            whole = await ledger.get(share.lease_id)
            assert whole == share
            assert time.time() - share.created_unix_s < 5
            await ledger.release(share.lease_id)
        finally:
            await client.aclose()

    asyncio.run(main())
