"""A stopped attempt's devices stay held (draining) until its processes are gone: the worker
reports the attempt's exit, or the drain times out (``drain_timeout_s``), or the worker's lease
lapses. Until then no other job is placed on them (a GPU would still hold the old job's memory).
Real scheduler server, real Redis, scripted workers (scheduler_helpers.py).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from async_guard import run
from scheduler_helpers import (
    ALLOCATING,
    CANCELLED,
    FAILED,
    QUEUED,
    RPC_TIMEOUT_S,
    RUNNING,
    ScriptedWorker,
    scheduler_mesh,
    scripted_worker,
    submit,
    wait_for_state,
)

from opentinker.scheduler.v1 import scheduler_pb2

pytestmark = pytest.mark.integration


async def _running(mesh, w: ScriptedWorker, name: str) -> str:
    """Submit a job, see it launched on ``w`` and RUNNING; its id."""
    job = await submit(mesh.stub, name)
    launch = (await w.next_command()).launch
    assert launch.job.job_id == job.job_id
    await w.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
    await wait_for_state(mesh.stub, job.job_id, RUNNING)
    return job.job_id


async def _cancel(mesh, job_id: str) -> None:
    request = scheduler_pb2.CancelJobRequest(job_id=job_id, reason="enough")
    await mesh.stub.CancelJob(request, timeout=RPC_TIMEOUT_S)


async def _stays_queued(mesh, job_id: str, seconds: float) -> None:
    """The job is not placed for ``seconds`` (several dispatch rounds: heartbeat 0.2 s). Not a
    read with a timeout: cancelling a read cancels the whole worker stream in grpc.aio."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        job = await mesh.running.stores.jobs.get(job_id)
        assert job.state == QUEUED, f"placed while the devices were draining: {job.reason}"
        await asyncio.sleep(0.1)


async def _devices(mesh) -> list[scheduler_pb2.DeviceStatus]:
    """What ListWorkers (the dashboard's view) says of the devices."""
    listed = await mesh.stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=RPC_TIMEOUT_S)
    return [d for w in listed.workers for d in w.devices]


async def _exited(w: ScriptedWorker, job_id: str, attempt: int = 1) -> None:
    exited = scheduler_pb2.JobExited(job_id=job_id, attempt=attempt, exit_code=-15, reason="")
    await w.send(exited=exited)


def test_a_cancelled_jobs_devices_go_to_the_next_job_only_after_its_exit(redis_url: str) -> None:
    async def main() -> None:
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=5.0) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            first = await _running(mesh, w, "first")
            second = await submit(mesh.stub, "second")
            await _cancel(mesh, first)
            assert (await w.next_command()).stop.job_id == first
            assert (await wait_for_state(mesh.stub, first, CANCELLED)).reason == "enough"
            await _stays_queued(mesh, second.job_id, 1.5)
            [held] = await mesh.running.stores.ledger.leases("w1")
            assert held.job_id == first and held.drain is not None and held.drain.attempt == 1
            [device] = await _devices(mesh)
            assert device.draining and device.job_id == first and device.leased
            assert device.draining_since_unix_s >= device.leased_since_unix_s > 0

            await _exited(w, first)
            launch = (await w.next_command()).launch
            assert launch.job.job_id == second.job_id
            assert launch.device_ids == ["w1/cpu:0"]
            [device] = await _devices(mesh)
            assert device.job_id == second.job_id and not device.draining

    run(main)


def test_a_drain_the_worker_never_reports_ends_after_drain_timeout_s(redis_url: str) -> None:
    async def main() -> None:
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=5.0, drain_timeout_s=2.0) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            first = await _running(mesh, w, "first")
            second = await submit(mesh.stub, "second")
            await _cancel(mesh, first)
            stopped = time.monotonic()
            assert (await w.next_command()).stop.job_id == first
            # The worker heartbeats (renewing the hold) but never reports the exit.
            launch = (await w.next_command(timeout_s=6.0)).launch
            assert launch.job.job_id == second.job_id
            assert time.monotonic() - stopped > 1.8  # not before the drain timed out
            # A late exit of the drained attempt changes nothing.
            await _exited(w, first)
            await asyncio.sleep(0.3)
            [lease] = await mesh.running.stores.ledger.leases("w1")
            assert lease.job_id == second.job_id and lease.drain is None

    run(main)


def test_a_requeued_attempt_is_placed_again_only_after_the_lapsed_one_exited(
    redis_url: str,
) -> None:
    """The lease lapsed while the worker still ran the attempt (its device key expired): the
    job is re-queued at once, and the worker told to stop, but the devices are held for the
    stopped attempt, so the next attempt starts only once it exited."""

    async def main() -> None:
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=5.0) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            job_id = await _running(mesh, w, "job")
            client = aioredis.Redis.from_url(redis_url)
            await client.delete("ot:ledger:device:w1/cpu:0")  # as if its TTL ran out
            await client.aclose()
            stop = (await w.next_command()).stop
            assert (stop.job_id, stop.attempt) == (job_id, 1)
            assert (await wait_for_state(mesh.stub, job_id, QUEUED)).attempt == 1
            await _stays_queued(mesh, job_id, 1.5)
            assert await mesh.running.stores.ledger.free_devices("w1") == []

            await _exited(w, job_id)
            launch = (await w.next_command()).launch
            assert (launch.job.job_id, launch.job.attempt) == (job_id, 2)

    run(main)


def test_a_lost_workers_drain_ends_when_its_lease_lapses(redis_url: str) -> None:
    """The worker went away after the stop (its stream dropped, no more heartbeats): nothing
    renews the hold, which lapses after the lease TTL and is released, the job left as it is."""

    async def main() -> None:
        async with scheduler_mesh(redis_url, lease_ttl_s=1.0, drain_timeout_s=60.0) as mesh:
            w = ScriptedWorker(mesh.worker_stub, "w1", ["w1/cpu:0"])
            await w.connect()
            try:
                first = await _running(mesh, w, "first")
                await _cancel(mesh, first)
                assert (await w.next_command()).stop.job_id == first
            finally:
                await w.disconnect()
            ledger = mesh.running.stores.ledger
            deadline = time.monotonic() + 5.0
            while await ledger.all_leases():
                assert time.monotonic() < deadline, "the drain of a lost worker never ended"
                await asyncio.sleep(0.1)
            assert (await mesh.running.stores.jobs.get(first)).state == CANCELLED

    run(main)


def test_a_requeued_job_waits_for_its_stopped_attempt_even_with_devices_free_elsewhere(
    redis_url: str,
) -> None:
    """Two attempts of one job never run at once (both would write its checkpoints): the
    re-queued job is not placed on the free worker w2 while its stopped attempt drains on
    w1."""

    async def main() -> None:
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=5.0) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1,
        ):
            job_id = await _running(mesh, w1, "job")
            async with scripted_worker(mesh.worker_stub, "w2", ["w2/cpu:0"]):
                client = aioredis.Redis.from_url(redis_url)
                await client.delete("ot:ledger:device:w1/cpu:0")  # as if its TTL ran out
                await client.aclose()
                assert (await w1.next_command()).stop.job_id == job_id
                await wait_for_state(mesh.stub, job_id, QUEUED)
                await _stays_queued(mesh, job_id, 1.5)

                await _exited(w1, job_id)
                placed = await wait_for_state(mesh.stub, job_id, ALLOCATING)
                assert placed.attempt == 2

    run(main)


async def _close(w: ScriptedWorker, *, jobs_stopped: bool | None) -> None:
    """The worker's last message; ``None``: an older worker's, without ``jobs_stopped``."""
    closing = scheduler_pb2.WorkerClosing(reason="shutting down")
    if jobs_stopped is not None:
        closing.jobs_stopped = jobs_stopped
    await w.send(closing=closing)
    w.heartbeating = False


def test_a_worker_closing_with_its_jobs_stopped_frees_their_devices_at_once(
    redis_url: str,
) -> None:
    """A worker that stopped its jobs before closing (jobs_stopped): its running job is
    re-queued and placed on w2 at once, not after the lease TTL (10 s), and the drain of a job
    cancelled before (whose exit it never reported) ends too."""

    async def main() -> None:
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=10.0) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0", "w1/cpu:1"]) as w1,
        ):
            cancelled = await _running(mesh, w1, "cancelled")
            job_id = await _running(mesh, w1, "job")
            await _cancel(mesh, cancelled)
            assert (await w1.next_command()).stop.job_id == cancelled
            async with scripted_worker(mesh.worker_stub, "w2", ["w2/cpu:0"]) as w2:
                await _close(w1, jobs_stopped=True)
                launch = (await w2.next_command(timeout_s=3.0)).launch
                assert (launch.job.job_id, launch.job.attempt) == (job_id, 2)
                assert await mesh.running.stores.ledger.leases("w1") == []

    run(main)


def test_a_worker_closing_without_jobs_stopped_still_drains(redis_url: str) -> None:
    """An older worker closes first and stops its jobs after (no jobs_stopped): its processes
    may still run, so its job, re-queued at once, waits for the drain (the lease lapsing) and
    is not placed on the free w2 meanwhile."""

    async def main() -> None:
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=3.0) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1,
        ):
            job_id = await _running(mesh, w1, "job")
            async with scripted_worker(mesh.worker_stub, "w2", ["w2/cpu:0"]):
                await _close(w1, jobs_stopped=None)
                assert (await wait_for_state(mesh.stub, job_id, QUEUED)).attempt == 1
                await _stays_queued(mesh, job_id, 1.5)
                [lease] = await mesh.running.stores.ledger.leases("w1")
                assert lease.job_id == job_id and lease.drain is not None
                placed = await wait_for_state(mesh.stub, job_id, ALLOCATING)  # once it lapsed
                assert placed.attempt == 2

    run(main)


def test_an_exit_reported_while_a_lapsed_lease_is_being_held_ends_the_hold(
    redis_url: str,
) -> None:
    """The lapsed-lease sweep forgot the worker's run of the attempt before it marked the lease
    draining: an exit reported in between found neither the run nor a drain to end, so the
    lease then drained for an attempt already gone, until drain_timeout_s (60 s). Here the
    exit is reported just as the hold is about to be written."""

    async def main() -> None:
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=5.0) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            job_id = await _running(mesh, w, "job")
            drains = mesh.running.scheduler._drains
            hold = drains.hold

            async def exit_first(*args, **kwargs) -> None:  # the exit wins the race
                failed = scheduler_pb2.JobExited(job_id=job_id, attempt=1, exit_code=1)
                await w.send(exited=failed)
                await wait_for_state(mesh.stub, job_id, FAILED)
                await hold(*args, **kwargs)

            drains.hold = exit_first
            client = aioredis.Redis.from_url(redis_url)
            await client.delete("ot:ledger:device:w1/cpu:0")  # as if its TTL ran out
            await client.aclose()
            deadline = time.monotonic() + 3.0
            while leases := await mesh.running.stores.ledger.leases("w1"):
                assert time.monotonic() < deadline, f"still held for the exited attempt: {leases}"
                await asyncio.sleep(0.1)

    run(main)
