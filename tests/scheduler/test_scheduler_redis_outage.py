"""A Redis that goes away, at any point of the scheduler's work: RPCs say UNAVAILABLE and work
again after, a connected worker's job survives an outage longer than the lease TTL, and a
dispatch, a requeue or a submit cut short by the outage leaks no lease and loses no job.

Real scheduler servers on a Redis of the test's own (conftest's ``redis_server``), killed and
started again; the worker side is scheduler_helpers' scripted ConnectWorker client.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from async_guard import run
from scheduler_helpers import (
    QUEUED,
    RUNNING,
    SUCCEEDED,
    get_job,
    report_result,
    scheduler_mesh,
    scripted_worker,
    start_job,
    submit,
    wait_for_state,
    watch,
)

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.launcher.redis_process import RedisProcess

pytestmark = pytest.mark.integration


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


def test_a_job_stored_just_before_a_redis_outage_runs_without_a_retry(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis goes away right after SubmitJob stored the job: the caller sees an error and never
    retries. The job entered the queue in the step that stored it, so once Redis is back it
    runs: a QUEUED job outside the queue would never run."""
    from opentinker.services.scheduler.jobs.job_store import RedisJobStore

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
    from opentinker.services.scheduler.leases.lease_ledger import RedisLeaseLedger

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
    from opentinker.services.scheduler.jobs.job_store import RedisJobStore

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
