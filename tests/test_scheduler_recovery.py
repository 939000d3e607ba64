"""Workers that reconnect, a scheduler that restarts, a Redis that goes away: nothing is lost.

Real scheduler servers on real Redis; the worker side is the scripted ConnectWorker client of
test_scheduler_service, so each re-announcement is exactly what the test says.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from async_guard import run
from identity_helpers import api_key
from scheduler_helpers import (
    ALLOCATING,
    FAILED,
    QUEUED,
    RPC_TIMEOUT_S,
    RUNNING,
    SUCCEEDED,
    Mesh,
    get_job,
    job_stub,
    scheduler_mesh,
    scripted_worker,
    states,
    submit,
    wait_for_state,
    watch,
)

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.launcher.redis_process import RedisProcess

pytestmark = pytest.mark.integration


def held(
    launch: scheduler_pb2.LaunchJob, *, launched: bool = True, exited: bool = False
) -> scheduler_pb2.HeldAttempt:
    return scheduler_pb2.HeldAttempt(
        job_id=launch.job.job_id,
        attempt=launch.job.attempt,
        lease_id=launch.lease_id,
        launched=launched,
        exited=exited,
    )


async def start_job(mesh: Mesh, worker, name: str, *, launched: bool = True):
    """Submit a job and take its launch on ``worker``; RUNNING when ``launched``."""
    job = await submit(mesh.stub, name)
    launch = (await worker.next_command()).launch
    assert launch.job.job_id == job.job_id
    if launched:
        await worker.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
        await wait_for_state(mesh.stub, job.job_id, RUNNING)
    return launch


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A Redis of the test's own (AOF on), which a test may kill and start again."""
    server = RedisProcess(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


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


async def report_result(mesh: Mesh, launch: scheduler_pb2.LaunchJob) -> None:
    """The trainer reports its result to the new scheduler (nothing tied it to the old one)."""
    result = scheduler_pb2.ReportJobProgressRequest(
        job_id=launch.job.job_id,
        attempt=1,
        result=scheduler_pb2.JobResult(checkpoint_uri="file:///ckpt"),
    )
    trainer = job_stub(mesh, launch)
    assert not (await trainer.ReportJobProgress(result, timeout=RPC_TIMEOUT_S)).stop


def test_rpcs_answer_unavailable_while_redis_is_away_and_work_again_after(
    redis_server: RedisProcess,
) -> None:
    import redis

    config = redis.Redis.from_url(redis_server.url, decode_responses=True)
    settings = config.config_get("append*")
    assert (settings["appendonly"], settings["appendfsync"]) == ("yes", "always")
    config.close()

    async def main() -> None:
        async with scheduler_mesh(redis_server.url) as mesh:
            job = await submit(mesh.stub, "kept")
            redis_server.kill()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await get_job(mesh.stub, job.job_id)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "cannot reach its Redis" in info.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await watch(mesh.stub, job.job_id)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            redis_server.start()  # same port, same data dir: the append-only file has it all
            again = await get_job(mesh.stub, job.job_id)
            assert (again.job_id, again.state) == (job.job_id, QUEUED)
            later = await submit(mesh.stub, "after")
            assert later.state == QUEUED

    run(main)


def test_a_redis_outage_longer_than_the_lease_ttl_keeps_a_connected_workers_job(
    redis_server: RedisProcess,
) -> None:

    async def main() -> None:
        async with (
            scheduler_mesh(redis_server.url, lease_ttl_s=0.6, reconnect_grace_s=5) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1,
        ):
            launch = await start_job(mesh, w1, "kept")
            redis_server.kill()
            await asyncio.sleep(1.5)  # the lease's TTL runs out while Redis is away
            redis_server.start()
            ledger = mesh.running.stores.ledger
            # The scheduler holds its connected worker's known lease again before any sweep.
            await asyncio.sleep(1.0)
            assert await ledger.is_live(launch.lease_id)
            assert await ledger.lapsed() == []
            job = await get_job(mesh.stub, launch.job.job_id)
            assert (job.state, job.attempt, job.worker_id) == (RUNNING, 1, "w1")
            # The worker was never told to stop it, and its exit still counts.
            await report_result(mesh, launch)
            await w1.send(exited=scheduler_pb2.JobExited(job_id=job.job_id, attempt=1, exit_code=0))
            done = await wait_for_state(mesh.stub, job.job_id, SUCCEEDED)
            assert done.attempt == 1
            assert await ledger.leases("w1") == []

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


def test_a_job_stored_just_before_a_redis_outage_runs_without_a_retry(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis goes away right after SubmitJob stored the job: the caller sees an error and never
    retries. The job entered the queue in the step that stored it, so once Redis is back it
    runs: a QUEUED job outside the queue would never run."""
    from opentinker.services.scheduler.job_store import RedisJobStore

    cut = redis_dies_after(monkeypatch, redis_server, RedisJobStore, "create")

    async def main() -> None:
        async with scheduler_mesh(redis_server.url, lease_ttl_s=5.0) as mesh:
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):  # an error, either way
                await asyncio.wait_for(submit(mesh.stub, "stored"), 3.0)
            assert cut.is_set()
            redis_server.start()
            async with scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                launch = (await w1.next_command(timeout_s=8.0)).launch
                assert (launch.job.spec.name, launch.job.attempt) == ("stored", 1)

    run(main)


def redis_dies_after(
    monkeypatch: pytest.MonkeyPatch, redis_server, cls: type, name: str, when=None
) -> asyncio.Event:  # noqa: ANN001
    """Kill ``redis_server`` right after the first call of ``cls.name`` (for which
    ``when(*args, **kwargs)`` holds) has returned: a real outage at one exact point. The
    event is set once it happened."""
    method, cut = getattr(cls, name), asyncio.Event()

    async def then_lose_redis(self, *args, **kwargs):  # noqa: ANN001, ANN202
        out = await method(self, *args, **kwargs)
        if not cut.is_set() and (when is None or when(*args, **kwargs)):
            cut.set()
            redis_server.kill()
        return out

    monkeypatch.setattr(cls, name, then_lose_redis)
    return cut


def test_a_dispatch_cut_short_by_a_redis_outage_leaks_no_lease(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis goes away right after the dispatcher took a lease and before the job left the
    queue (shorter than the lease TTL, which the worker's heartbeats keep renewing). Once Redis
    is back the lease must be given up and the job launched, not held by nobody forever."""
    from opentinker.services.scheduler.lease_ledger import RedisLeaseLedger

    cut = redis_dies_after(monkeypatch, redis_server, RedisLeaseLedger, "acquire")

    async def main() -> None:
        async with (
            scheduler_mesh(redis_server.url, lease_ttl_s=5.0) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1,
        ):
            job = await submit(mesh.stub, "cut-short")
            await cut.wait()
            await asyncio.sleep(1.0)  # the round fails: Redis is away
            redis_server.start()
            launch = (await w1.next_command(timeout_s=8.0)).launch
            assert (launch.job.job_id, launch.job.attempt) == (job.job_id, 1)
            leases = await mesh.running.stores.ledger.leases("w1")
            assert [lease.lease_id for lease in leases] == [launch.lease_id]

    run(main)


def test_a_requeue_cut_short_by_a_redis_outage_still_runs_the_job_again(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis goes away right after a killed attempt's job was moved back to QUEUED: once Redis
    is back the job must be in the queue and run again, not stay QUEUED outside it for ever."""
    from opentinker.services.scheduler.job_store import RedisJobStore

    cut = redis_dies_after(
        monkeypatch, redis_server, RedisJobStore, "transition", lambda _, to, **__: to == QUEUED
    )

    async def main() -> None:
        async with scheduler_mesh(redis_server.url, lease_ttl_s=5.0) as mesh:
            async with scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                first = await start_job(mesh, w1, "killed")
                killed = scheduler_pb2.JobExited(
                    job_id=first.job.job_id, attempt=1, exit_code=-9, reason="OOM-killed"
                )
                await w1.send(exited=killed)
                await cut.wait()
            await asyncio.sleep(1.0)
            redis_server.start()
            async with scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                again = (await w1.next_command(timeout_s=8.0)).launch
                assert (again.job.job_id, again.job.attempt) == (first.job.job_id, 2)

    run(main)


def test_a_requeued_job_is_placed_again_only_once_its_requeue_is_written(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed attempt's job enters the queue with its move to QUEUED; attempt 1's tokens are
    revoked and its QUEUED event written after that. No dispatch round may place attempt 2 in
    between: the revocation would take attempt 2's token too, and attempt 2's ALLOCATING event
    would come before the QUEUED one."""
    from opentinker.services.scheduler.identity import RedisIdentityStore

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
