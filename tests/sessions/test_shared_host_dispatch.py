"""Dispatch of LoRA sessions onto shared LoRA hosts (scheduler/placement/shared_hosts.py): the real
Scheduler on a real Redis, driven directly. With ``shared_lora_sessions`` = 2 two tenants' LoRA
sessions of one base share the one device of a worker (one host id, each lease a half); a third,
a full fine-tuning session and a session of another base wait; each share is charged half the
device's seconds. Off (0, the default), a session holds the whole device as before."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import identity_pb2
from opentinker.services.common.auth import Principal
from opentinker.services.scheduler.placement.worker_session import DeviceOffer, LaunchCommand
from opentinker.services.scheduler.scheduler import Scheduler
from opentinker.services.scheduler.stores import connect_redis, redis_stores
from opentinker.session_config import SessionConfig
from opentinker.spec import JobSpec, LoraConfig, ModelSpec, to_proto

pytestmark = pytest.mark.integration


def owner(tenant: str) -> Principal:
    return Principal(kind="user", key_prefix="k", tenant_id=tenant, user_id=f"u-{tenant}")


def session_spec(base: Path, *, lora: bool = True) -> common_pb2.JobSpec:
    model = (
        ModelSpec(base_model=str(base), lora=LoraConfig(rank=4))
        if lora
        else ModelSpec(base_model=str(base), finetune="full")
    )
    return to_proto(JobSpec(name="s", kind="session", model=model, session=SessionConfig()))


def launches(session) -> list[LaunchCommand]:
    out = []
    while not session.outbox.empty():
        command = session.outbox.get_nowait()
        if isinstance(command, LaunchCommand):
            out.append(command)
    return out


async def mesh(redis_url: str, shared: int):
    client = connect_redis(redis_url)
    await client.flushdb()
    stores = redis_stores(client, lease_ttl_s=10.0, server_secret=b"t" * 32)
    scheduler = Scheduler(
        stores, heartbeat_interval_s=1.0, lease_ttl_s=10.0, shared_lora_sessions=shared
    )
    worker = await scheduler.connect_worker("w1", "h1", [DeviceOffer("w1/cpu:0", "cpu")])
    return client, stores, scheduler, worker


def test_two_tenants_lora_sessions_share_the_one_device(
    redis_url: str, letter_model_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "another-base"  # another base model (by its name), the same files
    other.symlink_to(letter_model_dir)

    async def main() -> None:
        client, stores, scheduler, worker = await mesh(redis_url, shared=2)
        a = await scheduler.submit(session_spec(letter_model_dir), owner=owner("acme"))
        # Queued before b, finds no whole device: b still gets its place on the host
        full = await scheduler.submit(
            session_spec(letter_model_dir, lora=False), owner=owner("initech")
        )
        b = await scheduler.submit(session_spec(letter_model_dir), owner=owner("globex"))
        third = await scheduler.submit(session_spec(letter_model_dir), owner=owner("initech"))
        other_base = await scheduler.submit(session_spec(other), owner=owner("umbrella"))
        started = time.time()
        assert await scheduler.dispatch() == 2
        placed = {c.job.job_id: c for c in launches(worker)}
        assert set(placed) == {a.job_id, b.job_id}
        ca, cb = placed[a.job_id], placed[b.job_id]
        assert ca.host_id and ca.host_id == cb.host_id and ca.host_slots == 2
        assert ca.device_ids == cb.device_ids == ("w1/cpu:0",)
        for waiting in (full, third, other_base):  # no whole device, no slot, no host of it
            assert (await stores.jobs.get(waiting.job_id)).state == common_pb2.JOB_STATE_QUEUED
        assert await scheduler.dispatch() == 0
        # The workers' view: the device held by the host, its sessions and its room; each
        # tenant sees only its own session there
        for tenant, mine in (("acme", a.job_id), ("globex", b.job_id), ("initech", "")):
            [status], _ = await scheduler.overview.workers(tenant=tenant)
            [device] = status.devices
            assert device.leased and device.shared_host_id == ca.host_id
            assert (device.hosted_sessions, device.host_slots) == (2, 2)
            assert device.job_id == mine

        # Each share is charged half of the device's seconds
        await asyncio.sleep(0.5)
        assert await stores.ledger.release(cb.lease_id)
        held_s = time.time() - started
        used, _ = await stores.usage.tenant("globex")
        assert 0.2 < used.device_seconds <= 0.5 * held_s + 1e-6, (used, held_s)
        await client.aclose()

    asyncio.run(main())


def test_off_by_default_a_session_holds_the_whole_device(
    redis_url: str, letter_model_dir: Path
) -> None:
    async def main() -> None:
        client, stores, scheduler, worker = await mesh(redis_url, shared=0)
        a = await scheduler.submit(session_spec(letter_model_dir), owner=owner("acme"))
        b = await scheduler.submit(session_spec(letter_model_dir), owner=owner("globex"))
        assert await scheduler.dispatch() == 1
        [command] = launches(worker)
        assert command.job.job_id == a.job_id and command.host_id == ""
        lease = await stores.ledger.get(command.lease_id)
        assert lease is not None and lease.share == 1.0
        assert (await stores.jobs.get(b.job_id)).state == common_pb2.JOB_STATE_QUEUED
        await client.aclose()

    asyncio.run(main())


def test_a_tenant_of_one_device_holds_two_half_shares(
    redis_url: str, letter_model_dir: Path
) -> None:
    """max_devices counts a hosted session as its share: two sessions of 1/2 fit a quota of 1
    device; a whole-device session then does not (told why)."""

    async def main() -> None:
        client, stores, scheduler, worker = await mesh(redis_url, shared=2)
        await stores.identity.create_tenant("acme")
        await stores.identity.set_quota("acme", identity_pb2.TenantQuota(max_devices=1))
        a = await scheduler.submit(session_spec(letter_model_dir), owner=owner("acme"))
        b = await scheduler.submit(session_spec(letter_model_dir), owner=owner("acme"))
        assert await scheduler.dispatch() == 2
        assert {c.job.job_id for c in launches(worker)} == {a.job_id, b.job_id}
        await scheduler.connect_worker("w2", "h2", [DeviceOffer("w2/cpu:0", "cpu")])
        full = await scheduler.submit(
            session_spec(letter_model_dir, lora=False), owner=owner("acme")
        )
        assert await scheduler.dispatch() == 0
        waiting = await scheduler.get(full.job_id, tenant="acme")
        assert waiting.state == common_pb2.JOB_STATE_QUEUED
        assert "hold 1 of its 1 devices" in waiting.queue_reason, waiting.queue_reason
        await client.aclose()

    asyncio.run(main())


def test_a_session_joins_the_host_with_room_before_starting_another(
    redis_url: str, letter_model_dir: Path
) -> None:
    """w1's device was taken when the first session came (it started a host on w2); once w1's
    device is free the second session still joins w2's host, not a new host on w1."""

    async def main() -> None:
        client, stores, scheduler, w1 = await mesh(redis_url, shared=2)
        w2 = await scheduler.connect_worker("w2", "h2", [DeviceOffer("w2/cpu:0", "cpu")])
        whole = await stores.ledger.acquire("w1", "someone-else", 1)
        assert whole is not None
        a = await scheduler.submit(session_spec(letter_model_dir), owner=owner("acme"))
        assert await scheduler.dispatch() == 1
        [ca] = launches(w2)
        await stores.ledger.release(whole.lease_id)
        b = await scheduler.submit(session_spec(letter_model_dir), owner=owner("globex"))
        assert await scheduler.dispatch() == 1
        [cb] = launches(w2)
        assert (ca.job.job_id, cb.job.job_id) == (a.job_id, b.job_id)
        assert cb.host_id == ca.host_id and launches(w1) == []
        assert await stores.ledger.free_devices("w1") == ["w1/cpu:0"]
        await client.aclose()

    asyncio.run(main())
