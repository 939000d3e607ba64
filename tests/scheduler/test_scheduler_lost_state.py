"""Redis loses the scheduler's state (emptied under it, or before it starts): the scheduler says
so in its health and to every caller, tells its workers to close (not to stop their jobs), and
serves again once an operator restores Redis's data or re-bootstraps (lost_state.py).

Real scheduler servers on a Redis of the test's own (conftest's ``redis_server``), emptied with
FLUSHALL; the worker side is scheduler_helpers' scripted ConnectWorker client.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from async_guard import run
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scheduler_helpers import (
    RUNNING,
    Mesh,
    get_job,
    held,
    scheduler_mesh,
    scripted_worker,
    start_job,
    submit,
)

from opentinker.errors import REASON_METADATA_KEY
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.launcher.redis_process import RedisProcess
from opentinker.services.trainer.reporter import SchedulerReporter

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CHECK_S = 0.2  # instance_check_interval_s


def flushall(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


def rebootstrap(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opentinker.services.scheduler.rebootstrap", "--redis-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )


def restore(redis_server: RedisProcess, backup: Path) -> None:
    """What an operator does: Redis stopped, its data folder replaced by the backup, started."""
    redis_server.kill()
    shutil.rmtree(redis_server.data_dir)
    shutil.copytree(backup, redis_server.data_dir)
    redis_server.start()


async def wait_for_health(mesh: Mesh, status: int, within_s: float = 5.0) -> float:
    """Seconds until the scheduler's overall health and SchedulerService's both are ``status``."""
    started = time.monotonic()
    channel = grpc.aio.insecure_channel(mesh.running.address)
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        while True:
            found = [
                (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
                for name in (
                    "",
                    scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name,
                )
            ]
            if found == [status, status]:
                return time.monotonic() - started
            assert time.monotonic() - started < within_s, f"health is {found}, not {status}"
            await asyncio.sleep(0.05)
    finally:
        await channel.close()


async def refused_as_lost(call) -> None:  # noqa: ANN001 - an awaitable RPC
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    err = info.value
    assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
    assert "Redis state was lost" in err.details()
    assert (
        "restore" in err.details() and "opentinker.services.scheduler.rebootstrap" in err.details()
    )
    assert (REASON_METADATA_KEY, "STATE_LOST") in tuple(err.trailing_metadata() or ())


def test_a_redis_emptied_under_the_scheduler_is_refused_until_an_operator_rebootstraps(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    secrets = tmp_path / "secrets"

    async def main() -> None:
        async with scheduler_mesh(
            redis_server.url, bootstrap_dir=secrets, instance_check_interval_s=CHECK_S
        ) as mesh:
            await submit(mesh.stub, "before")
            old_admin = (secrets / "admin.key").read_text().strip()
            await wait_for_health(mesh, SERVING)

            flushall(redis_server.url)
            assert await wait_for_health(mesh, NOT_SERVING) < 10 * CHECK_S
            await refused_as_lost(submit(mesh.stub, "after"))
            await refused_as_lost(mesh.stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=5))

            done = rebootstrap(redis_server.url)
            assert done.returncode == 0, done.stderr
            again = rebootstrap(redis_server.url)  # a Redis that holds a marker is left alone
            assert again.returncode == 1 and "rebootstrap_refused" in again.stderr

            await wait_for_health(mesh, SERVING)
            new_admin = (secrets / "admin.key").read_text().strip()
            assert new_admin != old_admin  # made again: the old one was in the lost state
            channel = aio_channel(mesh.running.address, credential=new_admin)
            try:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                page = await stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=5)
                assert list(page.jobs) == []  # an empty deployment: the operator chose so
                assert (await submit(stub, "fresh")).job_id
            finally:
                await channel.close()

    run(main)


def test_a_worker_is_asked_to_close_not_to_stop_and_keeps_its_job_through_a_restore(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    """The worker's stream is closed (``closing``, never ``stop``); while the state is lost its
    reconnection is refused as such; once Redis's data is restored from a backup the scheduler
    serves again and the worker's re-announced attempt is adopted, still attempt 1."""
    backup = tmp_path / "backup"

    async def main() -> None:
        async with scheduler_mesh(
            redis_server.url, lease_ttl_s=5.0, instance_check_interval_s=CHECK_S
        ) as mesh:
            async with scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                launch = await start_job(mesh, w1, "kept")
                shutil.copytree(redis_server.data_dir, backup)  # AOF, fsynced at every write

                flushall(redis_server.url)
                message = await w1.next_command(timeout_s=10 * CHECK_S + 5)
                assert message.HasField("closing"), message
                assert "Redis state was lost" in message.closing.reason

            w2 = scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"], held=[held(launch)])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async with w2:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (REASON_METADATA_KEY, "STATE_LOST") in tuple(info.value.trailing_metadata())

            restore(redis_server, backup)
            await wait_for_health(mesh, SERVING)
            async with scripted_worker(
                mesh.worker_stub, "w1", ["w1/cpu:0"], held=[held(launch)]
            ) as back:
                job = await get_job(mesh.stub, launch.job.job_id)
                assert (job.state, job.attempt, job.worker_id) == (RUNNING, 1, "w1")
                with pytest.raises(TimeoutError):  # adopted: no stop comes
                    await back.next_command(timeout_s=1.0)

    run(main)


def test_a_scheduler_started_on_an_emptied_redis_refuses_until_rebootstrapped(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    """The bootstrap folder records the marker: a start on a Redis emptied meanwhile is not
    taken for a new deployment."""
    secrets = tmp_path / "secrets"

    async def main() -> None:
        async with scheduler_mesh(redis_server.url, bootstrap_dir=secrets) as mesh:
            await submit(mesh.stub, "before")
        flushall(redis_server.url)
        async with scheduler_mesh(
            redis_server.url, bootstrap_dir=secrets, instance_check_interval_s=CHECK_S
        ) as mesh:
            await wait_for_health(mesh, NOT_SERVING, within_s=1.0)
            await refused_as_lost(mesh.stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=5))
            assert rebootstrap(redis_server.url).returncode == 0
            await wait_for_health(mesh, SERVING)

    run(main)


def test_a_key_unknown_between_two_checks_is_refused_as_lost_state_not_unauthenticated(
    redis_server: RedisProcess,
) -> None:
    """The watch checks rarely here; a call whose key is not found reads the marker at once."""

    async def main() -> None:
        async with scheduler_mesh(redis_server.url, instance_check_interval_s=600) as mesh:
            await submit(mesh.stub, "before")
            flushall(redis_server.url)
            await refused_as_lost(mesh.stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=5))
            assert await wait_for_health(mesh, NOT_SERVING, within_s=0.5) < 0.5

    run(main)


def test_a_trainers_report_waits_while_the_state_is_lost_and_lands_after_a_restore(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    """The trainer's reporter gives a scheduler that is merely away ``retry_for_s``; one that
    says its state is lost is waited for (its job is kept), here four budgets long."""
    backup = tmp_path / "backup"

    async def main() -> None:
        async with scheduler_mesh(
            redis_server.url, lease_ttl_s=10.0, instance_check_interval_s=CHECK_S
        ) as mesh:
            async with scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                launch = await start_job(mesh, w1, "reports")
            shutil.copytree(redis_server.data_dir, backup)
            job_channel = aio_channel(mesh.running.address, credential=launch.job_token)
            reporter = SchedulerReporter(
                job_channel,
                address=mesh.running.address,
                job_id=launch.job.job_id,
                attempt=1,
                timeout_s=2,
                retry_for_s=0.5,
            )
            try:
                flushall(redis_server.url)
                await wait_for_health(mesh, NOT_SERVING)
                report = asyncio.create_task(reporter.report_step(1, 1, {"reward": 0.1}))
                await asyncio.sleep(2.0)
                assert not report.done()
                restore(redis_server, backup)
                assert await asyncio.wait_for(report, 15) is False  # taken; not told to stop
            finally:
                await job_channel.close()

    run(main)
