"""The real worker agent against the real scheduler (gRPC + Redis), launching real processes.

The rollout and trainer are other engineers' services; here two small scripts stand in for
them through the worker's ``rollout_command`` / ``trainer_command`` settings. They follow the
same contract: read ``--launch launch.json``, the rollout writes ``rollout.addr`` and waits, the
trainer (started at the same time, given ``--rollout-address-file``) reads the address there,
reports to the scheduler's ReportJobProgress and exits with a code. What each does is chosen by
the job's name.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from async_guard import run as guarded_run
from identity_helpers import api_key, worker_token

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.scheduler.server import RunningScheduler, running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.worker.agent import WorkerAgent
from opentinker.services.worker.devices import detect_devices
from opentinker.services.worker.settings import WorkerSettings
from opentinker.spec import JobSpec, RlConfig, to_proto

pytestmark = pytest.mark.integration

RPC_TIMEOUT_S = 5.0

STAND_IN_ROLLOUT = """
import os, sys, time
from pathlib import Path
from opentinker.services.common.launch import LaunchConfig, write_atomic

config = LaunchConfig.read(Path(sys.argv[sys.argv.index("--launch") + 1]))
(config.run_dir / "rollout.pid").write_text(str(os.getpid()))
name = config.job.spec.name
if name == "rollout-dies":
    print("RuntimeError: no generation engine", file=sys.stderr)
    sys.exit(4)
if name.startswith("beside-"):  # ready (or dead) only once the worker has started the trainer
    deadline = time.monotonic() + 20
    while not (config.run_dir / "trainer.pid").exists():
        if time.monotonic() > deadline:
            print("RuntimeError: no trainer was started beside this rollout", file=sys.stderr)
            sys.exit(5)
        time.sleep(0.05)
if name == "beside-rollout-dies":
    print("RuntimeError: the engine failed while the trainer started", file=sys.stderr)
    sys.exit(4)
if name not in ("never-ready", "trainer-dies-early"):
    write_atomic(config.run_dir / "rollout.addr", "127.0.0.1:1")
while True:
    time.sleep(1)
"""

STAND_IN_TRAINER = """
import os, sys, time
from pathlib import Path
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import sync_channel
from opentinker.services.common.launch import LaunchConfig

config = LaunchConfig.read(Path(sys.argv[sys.argv.index("--launch") + 1]))
job = config.job
(config.run_dir / "trainer.pid").write_text(str(os.getpid()))
name = job.spec.name
if name == "trainer-dies-early":  # before it needs the rollout, which is not ready yet
    print("ValueError: could not load the policy", file=sys.stderr)
    sys.exit(3)
address_file = Path(sys.argv[sys.argv.index("--rollout-address-file") + 1])
while not address_file.exists():  # as the trainer waits where it opens the rollout
    time.sleep(0.05)
address = address_file.read_text().strip()
(config.run_dir / "trainer.env").write_text(
    os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>") + "|" + address
)
if name in ("good", "beside-good"):
    channel = sync_channel(config.scheduler_address, credential=config.job_token)
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    stub.ReportJobProgress(
        scheduler_pb2.ReportJobProgressRequest(
            job_id=job.job_id,
            attempt=job.attempt,
            result=scheduler_pb2.JobResult(
                checkpoint_uri=f"file://{config.run_dir}/final", final_metrics={"reward": 1.0}
            ),
        ),
        timeout=5,
    )
    sys.exit(0)
if name == "bad":
    print("step 1 ok")
    print("ValueError: boom at step 2", file=sys.stderr)
    sys.exit(3)
if name == "exit-on-file":  # ends (failing) once the test writes run_dir/finish
    while not (config.run_dir / "finish").exists():
        time.sleep(0.05)
    print("ValueError: ended while the scheduler was away", file=sys.stderr)
    sys.exit(3)
while True:  # "hang": runs until stopped
    time.sleep(1)
"""


@dataclass
class Mesh:
    running: RunningScheduler
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    agent: WorkerAgent
    stop_agent: asyncio.Event
    agent_task: asyncio.Task[None]
    run_root: Path


@asynccontextmanager
async def mesh_with_agent(
    redis_url: str, tmp_path: Path, *, rollout_start_timeout_s: float = 30
) -> AsyncIterator[Mesh]:
    rollout_script = tmp_path / "stand_in_rollout.py"
    trainer_script = tmp_path / "stand_in_trainer.py"
    rollout_script.write_text(STAND_IN_ROLLOUT)
    trainer_script.write_text(STAND_IN_TRAINER)
    scheduler_settings = SchedulerSettings(
        redis_url=redis_url, port=0, heartbeat_interval_s=0.2, lease_ttl_s=1.5
    )
    async with running_scheduler(scheduler_settings, stop_grace_s=0.5) as running:
        identity = running.stores.identity
        settings = WorkerSettings(
            worker_token=await worker_token(identity, worker_id="agent-1"),
            scheduler_address=running.address,
            worker_id="agent-1",
            hostname="testhost",
            run_root=tmp_path / "runs",
            devices=["cpu:0"],
            rollout_command=[sys.executable, str(rollout_script)],
            trainer_command=[sys.executable, str(trainer_script)],
            rollout_start_timeout_s=rollout_start_timeout_s,
            stop_grace_s=2,
            connect_timeout_s=3,
            warm_spares=0,  # the stand-ins have no spare mode (test_warm_spares.py has it)
        )
        agent = WorkerAgent(settings, detect_devices(settings))
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        channel = aio_channel(running.address, credential=await api_key(identity))
        try:
            await asyncio.wait_for(agent.connected.wait(), RPC_TIMEOUT_S)
            yield Mesh(
                running,
                scheduler_pb2_grpc.SchedulerServiceStub(channel),
                agent,
                stop,
                task,
                settings.run_root,
            )
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            await channel.close()


def run(coro_fn: Callable[[], Awaitable[None]], timeout_s: float = 90) -> None:
    """Worker tests start processes: a longer deadline."""
    guarded_run(coro_fn, timeout_s)


async def submit(stub, name: str) -> common_pb2.Job:
    spec = to_proto(JobSpec(name=name, rl=RlConfig(env_name="letters", steps=3)))
    return (
        await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=RPC_TIMEOUT_S)
    ).job


async def wait_for_state(stub, job_id: str, state: int, timeout_s: float = 20.0) -> common_pb2.Job:
    deadline = time.monotonic() + timeout_s
    while True:
        job = (
            await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=RPC_TIMEOUT_S)
        ).job
        if job.state == state:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(
                f"job {job_id} is {common_pb2.JobState.Name(job.state)} ({job.reason}), "
                f"expected {common_pb2.JobState.Name(state)}"
            )
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def device_freed(mesh: Mesh, timeout_s: float = 5.0) -> bool:
    """True once the agent's one device is free in the ledger (the lease was released)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await mesh.running.stores.ledger.free_devices("agent-1") == ["testhost/cpu:0"]:
            return True
        await asyncio.sleep(0.05)
    return False


def pids(run_dir: Path) -> list[int]:
    return [int((run_dir / f"{name}.pid").read_text()) for name in ("rollout", "trainer")]


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
            await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
            run_dir = mesh.run_root / job.job_id / "attempt-1"
            await wait_until(lambda: (run_dir / "trainer.pid").exists())
            processes = pids(run_dir)
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
            assert requeued.reason == "worker agent-1 lost; re-queued"
            assert requeued.attempt == 1

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
