"""Workers that reconnect and a scheduler that restarts: nothing is lost. Redis going away:
test_scheduler_redis_outage.py.

Real scheduler servers on real Redis; the worker side is the scripted ConnectWorker client of
scheduler_helpers, so each re-announcement is exactly what the test says.
"""

from __future__ import annotations

import asyncio

import pytest
from async_guard import run
from identity_helpers import api_key
from scheduler_helpers import (
    ALLOCATING,
    FAILED,
    QUEUED,
    RPC_TIMEOUT_S,
    RUNNING,
    get_job,
    held,
    job_stub,
    report_result,
    scheduler_mesh,
    scripted_worker,
    start_job,
    states,
    submit,
    wait_for_state,
    watch,
)

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2

pytestmark = pytest.mark.integration


def test_a_reconnecting_worker_keeps_its_job_and_is_told_to_stop_strays(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            ledger = mesh.running.stores.ledger
            async with scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                launch = await start_job(mesh, w1, "kept")
            # The stream dropped; the worker is back well within the lease TTL, re-announcing
            # its job and an attempt the scheduler never gave it (a stray).
            stray = scheduler_pb2.HeldAttempt(
                job_id="job-stray", attempt=3, lease_id="lease-unknown", launched=True
            )
            ended_stray = scheduler_pb2.HeldAttempt(
                job_id="job-done", attempt=1, lease_id="lease-gone", launched=True, exited=True
            )
            async with scripted_worker(
                mesh.worker_stub, "w1", ["w1/cpu:0"], held=[held(launch), stray, ended_stray]
            ) as w1:
                stop = (await w1.next_command()).stop
                assert (stop.job_id, stop.attempt) == ("job-stray", 3)  # only the running stray
                assert "no longer the scheduler's" in stop.reason
                await asyncio.sleep(1.5)  # past the TTL: the adopted lease is renewed again
                job = await get_job(mesh.stub, launch.job.job_id)
                assert (job.state, job.attempt, job.worker_id) == (RUNNING, 1, "w1")
                assert await ledger.is_live(launch.lease_id)
                # A new job waits: the one device is still held by the adopted attempt.
                waiting = await submit(mesh.stub, "waits")
                await w1.send(
                    exited=scheduler_pb2.JobExited(
                        job_id=job.job_id, attempt=1, exit_code=1, reason="boom"
                    )
                )
                await wait_for_state(mesh.stub, job.job_id, FAILED)
                # Its exit releases the adopted lease: the waiting job gets the device.
                nxt = (await w1.next_command()).launch
                assert nxt.job.job_id == waiting.job_id
            events = await watch(mesh.stub, job.job_id)
            assert states(events).count(ALLOCATING) == 1  # one attempt, never re-queued

    run(main)


def test_a_restarted_scheduler_adopts_announced_jobs_and_requeues_the_rest(
    redis_url: str,
) -> None:
    async def main() -> None:
        devices = ["w1/cpu:0", "w1/cpu:1"]
        async with (
            scheduler_mesh(redis_url) as first,
            scripted_worker(first.worker_stub, "w1", devices) as w,
        ):
            running = await start_job(first, w, "running")
            allocating = await start_job(first, w, "launch-lost", launched=False)
        # The first scheduler shut down: it re-queued nothing.
        async with scheduler_mesh(redis_url, reconnect_grace_s=5.0) as second:
            job = await get_job(second.stub, allocating.job.job_id)
            assert (job.state, job.attempt) == (ALLOCATING, 1)
            # The worker comes back announcing only the running job (the launch never arrived).
            async with scripted_worker(
                second.worker_stub, "w1", devices, held=[held(running)]
            ) as w:
                # The unannounced lease is released and its job re-queued, then relaunched.
                relaunch = (await w.next_command()).launch
                assert (relaunch.job.job_id, relaunch.job.attempt) == (allocating.job.job_id, 2)
                kept = await get_job(second.stub, running.job.job_id)
                assert (kept.state, kept.attempt) == (RUNNING, 1)
                assert await second.running.stores.ledger.is_live(running.lease_id)
                assert await second.running.stores.ledger.get(allocating.lease_id) is None

    run(main)


def test_after_a_restart_lapsed_leases_wait_for_their_worker_until_the_grace_ends(
    redis_url: str,
) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url, lease_ttl_s=0.5) as first:
            async with scripted_worker(first.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                back = await start_job(first, w1, "worker-comes-back")
            async with scripted_worker(first.worker_stub, "w2", ["w2/cpu:0"]) as w2:
                gone = await start_job(first, w2, "worker-never-returns")
        async with scheduler_mesh(redis_url, lease_ttl_s=0.5, reconnect_grace_s=2.5) as second:
            ledger = second.running.stores.ledger
            await asyncio.sleep(1.0)  # both leases have lapsed; the grace holds them
            assert not await ledger.is_live(back.lease_id)
            for launch in (back, gone):
                assert (await get_job(second.stub, launch.job.job_id)).state == RUNNING
            # w1 is back within the grace, still running its attempt: adopted, lease revived.
            async with scripted_worker(second.worker_stub, "w1", ["w1/cpu:0"], held=[held(back)]):
                assert await ledger.is_live(back.lease_id)
                # w2 never comes back: once the grace is over its job is re-queued.
                requeued = await wait_for_state(second.stub, gone.job.job_id, QUEUED, 5)
                assert requeued.reason == "worker w2 lost; re-queued"
                kept = await get_job(second.stub, back.job.job_id)
                assert (kept.state, kept.attempt) == (RUNNING, 1)
                await report_result(second, back)

    run(main)


def test_a_watch_rides_out_a_scheduler_restart_without_missing_or_repeating(
    redis_url: str,
) -> None:
    import threading

    import opentinker
    from opentinker.services.launcher.processes import free_port

    async def main() -> None:
        port = free_port()
        async with scheduler_mesh(redis_url, port=port) as first:
            job = await submit(first.stub, "watched")
            key = await api_key(first.running.stores.identity)
        seen: list = []

        def follow() -> None:
            with opentinker.Client(f"127.0.0.1:{port}", api_key=key) as client:
                seen.extend(client.watch(job.job_id, reconnect_for=30))

        watcher = threading.Thread(target=follow)
        watcher.start()  # the scheduler is down: the watch waits for it
        await asyncio.sleep(1.0)
        async with scheduler_mesh(redis_url, port=port) as second:
            await asyncio.sleep(1.5)
            await second.stub.CancelJob(
                scheduler_pb2.CancelJobRequest(job_id=job.job_id, reason="seen"),
                timeout=RPC_TIMEOUT_S,
            )
            await asyncio.to_thread(watcher.join, 30)
        assert not watcher.is_alive()
        assert [e.state for e in seen] == ["QUEUED", "CANCELLED"]
        assert [e.seq for e in seen] == [1, 2]

    run(main, timeout_s=60)


def test_a_stale_attempts_late_launched_stops_only_that_attempt(redis_url: str) -> None:
    """The worker was away long enough for attempt 1 to be re-queued; back, it is told to stop
    that stray and given attempt 2 on the same device, and only then does attempt 1's
    JobLaunched (its processes were still starting) arrive. The scheduler must stop attempt 1
    alone: a stop naming no attempt stops every attempt of the job on the worker (held.py)."""

    async def main() -> None:
        async with scheduler_mesh(redis_url, lease_ttl_s=0.5) as mesh:
            async with scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                first = await start_job(mesh, w1, "relaunched", launched=False)
            job_id = first.job.job_id
            await wait_for_state(mesh.stub, job_id, QUEUED)  # the lease lapsed
            async with scripted_worker(
                mesh.worker_stub, "w1", ["w1/cpu:0"], held=[held(first, launched=False)]
            ) as w1:
                stray = (await w1.next_command()).stop
                assert (stray.job_id, stray.attempt) == (job_id, 1)
                second = (await w1.next_command()).launch
                assert (second.job.job_id, second.job.attempt) == (job_id, 2)
                await w1.send(launched=scheduler_pb2.JobLaunched(job_id=job_id, attempt=1))
                stop = (await w1.next_command()).stop
                assert (stop.job_id, stop.attempt) == (job_id, 1)
                await w1.send(launched=scheduler_pb2.JobLaunched(job_id=job_id, attempt=2))
                job = await wait_for_state(mesh.stub, job_id, RUNNING)
                assert job.attempt == 2

    run(main)


def test_a_requeued_job_is_placed_again_only_once_its_requeue_is_written(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed attempt's job enters the queue with its move to QUEUED; attempt 1's tokens are
    revoked and its QUEUED event written after that. No dispatch round may place attempt 2 in
    between: the revocation would take attempt 2's token too, and attempt 2's ALLOCATING event
    would come before the QUEUED one."""
    from opentinker.services.scheduler.tenants.identity import RedisIdentityStore

    revoke = RedisIdentityStore.revoke_job_tokens

    async def main() -> None:
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=5.0) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1,
        ):
            first = await start_job(mesh, w1, "killed")
            job_id, jobs = first.job.job_id, mesh.running.stores.jobs
            while_revoking: list[tuple[int, int]] = []

            async def slow_revoke(self, job_id: str) -> None:  # noqa: ANN001
                await asyncio.sleep(0.6)  # several dispatch rounds (one each 0.2 s)
                job = await jobs.get(job_id)
                while_revoking.append((job.state, job.attempt))
                await revoke(self, job_id)

            monkeypatch.setattr(RedisIdentityStore, "revoke_job_tokens", slow_revoke)
            killed = scheduler_pb2.JobExited(job_id=job_id, attempt=1, exit_code=-9)
            await w1.send(exited=killed)
            second = (await w1.next_command()).launch
            assert second.job.attempt == 2
            assert while_revoking == [(QUEUED, 1)]
            step = scheduler_pb2.ReportJobProgressRequest(
                job_id=job_id, attempt=2, step=common_pb2.StepMetrics(step=1)
            )
            reply = await job_stub(mesh, second).ReportJobProgress(step, timeout=RPC_TIMEOUT_S)
            assert not reply.stop  # attempt 2's token works
            events = mesh.running.stores.events.read(job_id, follow=False)
            assert states([e async for e in events]) == [
                QUEUED, ALLOCATING, RUNNING, QUEUED, ALLOCATING
            ]  # fmt: skip

    run(main)


def test_a_queued_job_left_outside_the_queue_by_a_crash_runs_after_the_restart(
    redis_url: str,
) -> None:
    """The scheduler died mid-placement: the job's lease taken and the job out of the queue,
    but not yet ALLOCATING. After the restart the worker re-announces nothing, so the lease is
    an orphan: released, and its QUEUED job must be queued again, not left outside for ever."""

    async def main() -> None:
        async with scheduler_mesh(redis_url) as first:
            job = await submit(first.stub, "orphaned")  # no worker yet: it stays queued
            stores = first.running.stores
            await stores.ledger.register_worker("w1", ["w1/cpu:0"])
            lease = await stores.ledger.acquire("w1", job.job_id, 1)  # what the crash left
            assert lease is not None and await stores.queue.remove(job.job_id)
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=5.0, reconnect_grace_s=5.0) as second,
            scripted_worker(second.worker_stub, "w1", ["w1/cpu:0"]) as w1,
        ):
            launch = (await w1.next_command()).launch
            assert (launch.job.job_id, launch.job.attempt) == (job.job_id, 1)
            assert await second.running.stores.ledger.get(lease.lease_id) is None

    run(main)
