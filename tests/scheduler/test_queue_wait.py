"""A queued job says where it stands and why: GetJob's queue_position and queue_reason (a
client waiting for its session to start tells its user, never a silent wait)."""

from __future__ import annotations

import asyncio
import time

import pytest
from async_guard import run
from identity_helpers import api_key
from scheduler_helpers import get_job, scheduler_mesh, scripted_worker, stub_with, submit

import opentinker
from opentinker.common.v1 import common_pb2
from opentinker.errors import UnavailableError
from opentinker.scheduler.v1 import identity_pb2

pytestmark = pytest.mark.integration


async def told(stub, job_id: str, reason_part: str, within_s: float = 10) -> common_pb2.Job:  # noqa: ANN001
    """The job once its queue_reason says ``reason_part`` (rounds come late on a busy host)."""
    deadline = time.monotonic() + within_s
    while True:
        job = await get_job(stub, job_id)
        if reason_part in job.queue_reason or time.monotonic() > deadline:
            return job
        await asyncio.sleep(0.05)


def test_queued_jobs_are_told_their_position_and_reason(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            first = await submit(mesh.stub, "first")
            job = await told(mesh.stub, first.job_id, "no worker")
            assert job.queue_position == 1, job
            assert job.queue_reason == "no worker is connected; it is placed when one joins"
            second = await submit(mesh.stub, "second")
            async with scripted_worker(mesh.worker_stub, "w1", ["d0"]) as w:
                assert (await w.next_command()).launch.job.job_id == first.job_id
                job = await told(mesh.stub, second.job_id, "free device")
                assert job.state == common_pb2.JOB_STATE_QUEUED
                assert job.queue_position == 1  # the first left the queue
                assert job.queue_reason == (
                    "waiting for 1 free device(s): every device of the 1 connected worker(s) "
                    "that could hold it is leased"
                )
                placed = await get_job(mesh.stub, first.job_id)
                assert (placed.queue_position, placed.queue_reason) == (0, "")

    run(main)


def test_a_tenant_at_its_quota_is_told_so(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            key = await api_key(mesh.running.stores.identity, tenant="globex", user="bob")
            await mesh.running.stores.identity.set_quota(
                "globex", identity_pb2.TenantQuota(max_devices=1)
            )
            globex = stub_with(mesh, key)
            one = await submit(globex, "one")
            two = await submit(globex, "two")
            async with scripted_worker(mesh.worker_stub, "w1", ["d0", "d1"]) as w:
                assert (await w.next_command()).launch.job.job_id == one.job_id
                job = await told(globex, two.job_id, "max_devices")
                assert job.queue_reason == (
                    "the tenant's jobs hold 1 of its 1 devices (max_devices); it needs 1 more"
                )
                assert job.queue_position == 1

    run(main)


def test_a_session_that_cannot_start_says_why_it_waited(redis_url: str) -> None:
    """The SDK's session client gives up after ``wait_timeout`` naming the queue reason."""

    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            key = await api_key(mesh.running.stores.identity, tenant="initech", user="peter")

            def open_session() -> str:
                with opentinker.Client(mesh.running.address, api_key=key) as client:
                    with pytest.raises(UnavailableError) as caught:
                        client.training_session(base_model="tiny", lora_rank=4, wait_timeout=1)
                    return str(caught.value)

            message = await asyncio.to_thread(open_session)
            assert "still QUEUED after 1 s (position 1 in the queue: no worker is connected" in (
                message
            ), message

    run(main)
