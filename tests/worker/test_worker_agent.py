"""The real worker agent against the real scheduler (gRPC + Redis), launching real processes.

The rollout and trainer are other engineers' services; two small scripts stand in for them
(worker_agent_helpers.py: what each does is chosen by the job's name).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from identity_helpers import api_key, worker_token
from scheduler_helpers import scripted_worker
from worker_agent_helpers import (
    RPC_TIMEOUT_S,
    STAND_IN_ROLLOUT,
    STAND_IN_TRAINER,
    alive,
    device_freed,
    mesh_with_agent,
    pids,
    run,
    running_processes,
    submit,
    wait_for_state,
    wait_until,
)

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.scheduler.server import RunningScheduler, running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.worker.agent import WorkerAgent
from opentinker.services.worker.devices import detect_devices
from opentinker.services.worker.settings import WorkerSettings

pytestmark = pytest.mark.integration


def test_agent_launches_jobs_and_reports_how_they_exit(redis_url: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path) as mesh:
            good = await submit(mesh.stub, "good")
            done = await wait_for_state(mesh.stub, good.job_id, common_pb2.JOB_STATE_SUCCEEDED)
            run_dir = mesh.run_root / good.job_id / "attempt-1"
            assert done.checkpoint_uri == f"file://{run_dir.resolve()}/final"
            assert dict(done.final_metrics) == {"reward": 1.0}
            assert (run_dir / "launch.json").exists()
            # CPU lease: no GPU visible; the trainer got the rollout's address.
            assert (run_dir / "trainer.env").read_text() == "|127.0.0.1:1"
            rollout_pid, _ = pids(run_dir)
            await wait_until(lambda: not alive(rollout_pid))  # stopped once the trainer ended

            bad = await submit(mesh.stub, "bad")
            failed = await wait_for_state(mesh.stub, bad.job_id, common_pb2.JOB_STATE_FAILED)
            assert failed.reason == "ValueError: boom at step 2"

            early = await submit(mesh.stub, "rollout-dies")
            failed = await wait_for_state(mesh.stub, early.job_id, common_pb2.JOB_STATE_FAILED)
            assert "rollout process died with exit code 4" in failed.reason
            assert "RuntimeError: no generation engine" in failed.reason
            assert await device_freed(mesh)

    run(main)


def test_cancel_stops_both_processes(redis_url: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path) as mesh:
            job = await submit(mesh.stub, "hang")
            processes = await running_processes(mesh, job.job_id)
            assert all(alive(pid) for pid in processes)
            if "OMP_NUM_THREADS" not in os.environ:  # the CPU share counts the running job
                share = mesh.run_root / ".cpu-threads-agent-1"
                cores = os.cpu_count() or 1  # one core left to the rest; and every core
                assert share.read_text() == f"{max(1, cores - 1)} {cores}\n"
            await mesh.stub.CancelJob(
                scheduler_pb2.CancelJobRequest(job_id=job.job_id, reason="user stop"),
                timeout=RPC_TIMEOUT_S,
            )
            await wait_until(lambda: not any(alive(pid) for pid in processes))
            job = await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_CANCELLED)
            assert job.reason == "user stop"
            assert await device_freed(mesh)
            # The device is usable again right away.
            good = await submit(mesh.stub, "good")
            await wait_for_state(mesh.stub, good.job_id, common_pb2.JOB_STATE_SUCCEEDED)

    run(main)


def test_the_next_job_starts_only_once_the_cancelled_jobs_processes_exited(
    redis_url: str, tmp_path: Path
) -> None:
    """The cancelled trainer takes a second to exit after its SIGTERM (as one saving its state
    does): the queued job that needs its device is placed only after that, when the agent has
    reported the exit, never while the old processes still hold the device."""

    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path) as mesh:
            slow = await submit(mesh.stub, "slow-stop")
            processes = await running_processes(mesh, slow.job_id, ready="trainer.slow")
            good = await submit(mesh.stub, "good")
            await mesh.stub.CancelJob(
                scheduler_pb2.CancelJobRequest(job_id=slow.job_id, reason="user stop"),
                timeout=RPC_TIMEOUT_S,
            )
            cancelled = await mesh.running.stores.jobs.get(slow.job_id)
            assert cancelled.state == common_pb2.JOB_STATE_CANCELLED  # at once
            jobs = mesh.running.stores.jobs
            while (await jobs.get(good.job_id)).state == common_pb2.JOB_STATE_QUEUED:
                await asyncio.sleep(0.02)
            assert not any(alive(pid) for pid in processes), "placed beside the old processes"
            await wait_for_state(mesh.stub, good.job_id, common_pb2.JOB_STATE_SUCCEEDED)

    run(main)


def test_agent_shutdown_kills_its_processes_and_the_job_is_requeued(
    redis_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path) as mesh:
            job = await submit(mesh.stub, "hang")
            await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
            run_dir = mesh.run_root / job.job_id / "attempt-1"
            await wait_until(lambda: (run_dir / "trainer.pid").exists())
            processes = pids(run_dir)
            mesh.stop_agent.set()
            await asyncio.wait_for(mesh.agent_task, 15)
            assert not any(alive(pid) for pid in processes)
            requeued = await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_QUEUED)
            assert requeued.reason == "worker agent-1 shut down: stopped by its operator; re-queued"
            assert requeued.attempt == 1

    run(main)


def test_a_gracefully_stopped_agent_frees_its_jobs_devices_once_their_processes_exited(
    redis_url: str, tmp_path: Path
) -> None:
    """The agent, told to stop (SIGTERM), stops its jobs first (the slow-stop trainer takes a
    second) and only then says it closes, with its processes gone: the re-queued job goes to
    another worker right away, not once the lease lapses (the TTL, 10 s here), and never while
    the old processes are alive."""

    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path, lease_ttl_s=10.0) as mesh:
            job = await submit(mesh.stub, "slow-stop")
            processes = await running_processes(mesh, job.job_id, ready="trainer.slow")
            token = await worker_token(mesh.running.stores.identity)
            channel = aio_channel(mesh.running.address, credential=token)
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            async with scripted_worker(stub, "w2", ["w2/cpu:0"]) as w2:
                stopped = time.monotonic()
                mesh.stop_agent.set()
                launch = (await w2.next_command(timeout_s=6.0)).launch
                placed_s = time.monotonic() - stopped
                assert not any(alive(pid) for pid in processes), "placed beside the old processes"
                assert (launch.job.job_id, launch.job.attempt) == (job.job_id, 2)
                assert placed_s < 5.0, f"placed {placed_s:.1f} s after the stop"
                assert await mesh.running.stores.ledger.leases("agent-1") == []
                await asyncio.wait_for(mesh.agent_task, 15)
            await channel.close()

    run(main)


def test_a_launch_that_reaches_a_stopping_agent_is_never_started(
    redis_url: str, tmp_path: Path
) -> None:
    """The scheduler places a job on the agent's free device while the agent stops its jobs
    before closing: the launch is not started, and the closing re-queues the job, its lease
    released."""

    async def main() -> None:
        devices = ("cpu:0", "cpu:1")
        async with mesh_with_agent(redis_url, tmp_path, lease_ttl_s=10.0, devices=devices) as mesh:
            slow = await submit(mesh.stub, "slow-stop")
            await running_processes(mesh, slow.job_id, ready="trainer.slow")
            mesh.stop_agent.set()
            await asyncio.sleep(0.2)  # the agent is stopping the slow trainer (1 s)
            late = await submit(mesh.stub, "hang")
            await asyncio.wait_for(mesh.agent_task, 15)
            requeued = await mesh.running.stores.jobs.get(late.job_id)
            assert requeued.attempt == 1, "never placed on the agent"
            assert requeued.state == common_pb2.JOB_STATE_QUEUED
            assert requeued.reason == "worker agent-1 shut down: stopped by its operator; re-queued"
            assert not (mesh.run_root / late.job_id).exists(), "the late launch was started"
            assert await mesh.running.stores.ledger.all_leases() == []

    run(main)


def restartable(
    tmp_path: Path, redis_url: str, *, devices: list[str], **worker: object
) -> tuple[SchedulerSettings, WorkerSettings]:
    """Settings of a scheduler on a fixed port (so it can be restarted there) and its agent."""
    from opentinker.services.launcher.redis_process import free_port

    (tmp_path / "rollout.py").write_text(STAND_IN_ROLLOUT)
    (tmp_path / "trainer.py").write_text(STAND_IN_TRAINER)
    scheduler_settings = SchedulerSettings(
        redis_url=redis_url,
        port=free_port(),
        heartbeat_interval_s=0.2,
        lease_ttl_s=1.5,
        reconnect_grace_s=10,
        # The first scheduler writes a worker token there; the agent reads it at each connect.
        bootstrap_dir=tmp_path / "secrets",
    )
    options: dict = {
        "worker_token_file": tmp_path / "secrets" / "worker.token",
        "scheduler_address": f"127.0.0.1:{scheduler_settings.port}",
        "worker_id": "agent-1",
        "hostname": "testhost",
        "run_root": tmp_path / "runs",
        "devices": devices,
        "rollout_command": [sys.executable, str(tmp_path / "rollout.py")],
        "trainer_command": [sys.executable, str(tmp_path / "trainer.py")],
        "stop_grace_s": 2,
        "connect_timeout_s": 3,
        "reconnect_initial_s": 0.1,
        "reconnect_max_s": 0.5,
        "warm_spares": 0,  # the stand-ins have no spare mode (test_warm_spares.py has it)
        **worker,
    }
    return scheduler_settings, WorkerSettings(**options)


@asynccontextmanager
async def running_agent(settings: WorkerSettings) -> AsyncIterator[WorkerAgent]:
    agent = WorkerAgent(settings, detect_devices(settings))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield agent
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


@asynccontextmanager
async def serving(
    settings: SchedulerSettings, agent: WorkerAgent
) -> AsyncIterator[tuple[RunningScheduler, scheduler_pb2_grpc.SchedulerServiceStub]]:
    """A scheduler (again) on its port, once the agent has (re)connected to it."""
    async with running_scheduler(settings, stop_grace_s=0.5) as running:
        await asyncio.wait_for(agent.connected.wait(), 10)
        channel = aio_channel(running.address, credential=await api_key(running.stores.identity))
        try:
            yield running, scheduler_pb2_grpc.SchedulerServiceStub(channel)
        finally:
            await channel.close()


def test_agent_reconnects_after_a_scheduler_restart(redis_url: str, tmp_path: Path) -> None:
    async def main() -> None:
        scheduler_settings, settings = restartable(tmp_path, redis_url, devices=["cpu:0"])
        async with running_agent(settings) as agent:
            async with serving(scheduler_settings, agent) as (first, _):
                assert first.scheduler.connected_workers() == ["agent-1"]
            await asyncio.sleep(0.5)  # the scheduler is down: the agent keeps retrying
            assert not agent.connected.is_set()
            async with serving(scheduler_settings, agent) as (_, stub):
                job = await submit(stub, "good")
                await wait_for_state(stub, job.job_id, common_pb2.JOB_STATE_SUCCEEDED)

    run(main)


def test_jobs_run_on_through_a_scheduler_restart_and_exits_are_reported_after_it(
    redis_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        scheduler_settings, settings = restartable(tmp_path, redis_url, devices=["cpu:0", "cpu:1"])
        async with running_agent(settings) as agent:
            async with serving(scheduler_settings, agent) as (_, stub):
                hang = await submit(stub, "hang")
                ends = await submit(stub, "exit-on-file")
                for job in (hang, ends):
                    await wait_for_state(stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
            hang_dir = settings.run_root / hang.job_id / "attempt-1"
            ends_dir = settings.run_root / ends.job_id / "attempt-1"
            await wait_until(lambda: (hang_dir / "trainer.pid").exists())
            await wait_until(lambda: (ends_dir / "trainer.pid").exists())
            # The scheduler is down: one job ends meanwhile, the other runs on.
            (ends_dir / "finish").write_text("")
            await wait_until(lambda: not alive(pids(ends_dir)[1]))
            assert all(alive(pid) for pid in pids(hang_dir))
            async with serving(scheduler_settings, agent) as (_, stub):
                # The exit that happened while no scheduler listened is reported after reconnecting.
                failed = await wait_for_state(stub, ends.job_id, common_pb2.JOB_STATE_FAILED)
                assert failed.reason == "ValueError: ended while the scheduler was away"
                running = await wait_for_state(stub, hang.job_id, common_pb2.JOB_STATE_RUNNING)
                assert running.attempt == 1 and all(alive(pid) for pid in pids(hang_dir))
                await stub.CancelJob(
                    scheduler_pb2.CancelJobRequest(job_id=hang.job_id), timeout=RPC_TIMEOUT_S
                )
                await wait_until(lambda: not any(alive(pid) for pid in pids(hang_dir)))
                request = scheduler_pb2.WatchJobRequest(job_id=hang.job_id)
                events = [r.event async for r in stub.WatchJob(request, timeout=RPC_TIMEOUT_S)]
                allocating = common_pb2.JOB_STATE_ALLOCATING
                # One attempt: the restart never re-queued it.
                assert [e.state_change.state for e in events].count(allocating) == 1

    run(main)


def test_jobs_are_stopped_once_no_scheduler_was_reachable_for_the_orphan_grace(
    redis_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        scheduler_settings, settings = restartable(
            tmp_path, redis_url, devices=["cpu:0"], orphan_grace_s=1.0
        )
        async with running_agent(settings) as agent:
            async with serving(scheduler_settings, agent) as (_, stub):
                job = await submit(stub, "hang")
                await wait_for_state(stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
            run_dir = settings.run_root / job.job_id / "attempt-1"
            await wait_until(lambda: (run_dir / "trainer.pid").exists())
            processes = pids(run_dir)
            await asyncio.sleep(0.5)
            assert all(alive(pid) for pid in processes)  # within the grace: still running
            await wait_until(lambda: not any(alive(pid) for pid in processes), timeout_s=8)
            async with serving(scheduler_settings, agent) as (_, stub):
                # The worker announced nothing: its lease is released and the job relaunched.
                again = await wait_for_state(stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
                assert again.attempt == 2

    run(main)


def test_a_job_waits_for_the_processes_an_orphaned_attempt_left_on_its_device(
    redis_url: str, tmp_path: Path
) -> None:
    """The agent stopped an attempt itself (no scheduler for the orphan grace), which the
    scheduler never hears of: back, it re-queues the job and places it on the same device at
    once. The new attempt starts only once the old one's processes (6 s to stop) are gone."""

    async def main() -> None:
        scheduler_settings, settings = restartable(
            tmp_path, redis_url, devices=["cpu:0"], orphan_grace_s=0.5, stop_grace_s=10
        )
        async with running_agent(settings) as agent:
            async with serving(scheduler_settings, agent) as (_, stub):
                job = await submit(stub, "slower-stop")
                await wait_for_state(stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
                first = settings.run_root / job.job_id / "attempt-1"
                await wait_until(lambda: (first / "trainer.slow").exists())
            await wait_until(lambda: (first / "trainer.stopping").exists(), timeout_s=8)
            async with serving(scheduler_settings, agent) as (_, stub):
                again = await wait_for_state(stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
                assert again.attempt == 2
                second = settings.run_root / job.job_id / "attempt-2"
                await wait_until(lambda: (second / "rollout.pid").exists(), timeout_s=15)
                started = (second / "rollout.pid").stat().st_mtime
                stopped = first / "trainer.stopped"
                assert stopped.exists(), "attempt 2 started while attempt 1 was still stopping"
                assert started >= float(stopped.read_text()), "attempt 2 started beside attempt 1"
                assert not any(alive(pid) for pid in pids(first))
                # The wait was said in the job's events (JobWaiting), naming what held the device.
                await stub.CancelJob(
                    scheduler_pb2.CancelJobRequest(job_id=job.job_id), timeout=RPC_TIMEOUT_S
                )
                request = scheduler_pb2.WatchJobRequest(job_id=job.job_id)
                lines = [
                    r.event.log.message
                    async for r in stub.WatchJob(request, timeout=RPC_TIMEOUT_S)
                    if r.event.HasField("log")
                ]
                waits = [line for line in lines if line.startswith("waiting for its devices")]
                assert waits == [
                    f"waiting for its devices (testhost/cpu:0), still held here by {job.job_id}/1"
                ], lines

    run(main)


def test_jobs_are_kept_past_the_orphan_grace_while_the_scheduler_says_its_redis_state_is_lost(
    redis_url: str, tmp_path: Path
) -> None:
    """Redis emptied under the scheduler: it refuses the agent with STATE_LOST, and the agent,
    knowing nothing was re-queued, keeps its job running well past the orphan grace; once the
    operator re-bootstraps, the scheduler (knowing no such job) has it stopped."""
    import subprocess

    import redis

    async def main() -> None:
        scheduler_settings, settings = restartable(
            tmp_path, redis_url, devices=["cpu:0"], orphan_grace_s=1.0
        )
        scheduler_settings = scheduler_settings.model_copy(
            update={"instance_check_interval_s": 0.2}
        )
        async with (
            running_agent(settings) as agent,
            serving(scheduler_settings, agent) as (_, stub),
        ):
            job = await submit(stub, "hang")
            await wait_for_state(stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
            run_dir = settings.run_root / job.job_id / "attempt-1"
            await wait_until(lambda: (run_dir / "trainer.pid").exists())
            processes = pids(run_dir)
            client = redis.Redis.from_url(redis_url)  # database 0: this test's only
            client.flushdb()
            client.close()
            await wait_until(lambda: not agent.connected.is_set(), timeout_s=5)
            await asyncio.sleep(3.0)  # three orphan graces, refused all along
            assert all(alive(pid) for pid in processes)
            assert not agent.connected.is_set()

            done = subprocess.run(
                [sys.executable, "-m", "opentinker.services.scheduler.rebootstrap"]
                + ["--redis-url", redis_url],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            await asyncio.wait_for(agent.connected.wait(), 10)  # the new worker.token
            await wait_until(lambda: not any(alive(pid) for pid in processes), timeout_s=10)

    run(main)
