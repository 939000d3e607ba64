"""The worker agent's test harness: a real scheduler (gRPC + Redis) and a real worker agent
whose ``rollout_command`` / ``trainer_command`` run two small stand-in scripts. They follow the
services' contract: read ``--launch launch.json``, the rollout writes ``rollout.addr`` and waits,
the trainer (started at the same time, given ``--rollout-address-file``) reads the address
there, reports to the scheduler's ReportJobProgress and exits with a code. What each does is
chosen by the job's name. Used by test_worker_agent.py, test_job_start.py and
test_scheduler_attempts.py.
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

from async_guard import run as guarded_run
from identity_helpers import api_key, worker_token
from scheduler_helpers import wait_for_state as scheduler_wait_for_state

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.scheduler.server import RunningScheduler, running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.worker.agent import WorkerAgent
from opentinker.services.worker.devices import detect_devices
from opentinker.services.worker.settings import WorkerSettings
from opentinker.spec import JobSpec, RlConfig, to_proto

RPC_TIMEOUT_S = 5.0

STAND_IN_ROLLOUT = """
import os, sys, time
from pathlib import Path
from opentinker.services.common.launch import LaunchConfig, write_atomic

config = LaunchConfig.read(Path(sys.argv[sys.argv.index("--launch") + 1]))
write_atomic(config.run_dir / "rollout.pid", str(os.getpid()))
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
from opentinker.services.common.launch import LaunchConfig, write_atomic

config = LaunchConfig.read(Path(sys.argv[sys.argv.index("--launch") + 1]))
job = config.job
write_atomic(config.run_dir / "trainer.pid", str(os.getpid()))
name = job.spec.name
if name in ("slow-stop", "slower-stop"):  # outlives a SIGTERM, as a trainer saving its state
    import signal
    def on_sigterm(*_):  # says when its stop began and when it ended
        (config.run_dir / "trainer.stopping").write_text(str(time.time()))
        time.sleep(1.0 if name == "slow-stop" else 6.0)
        (config.run_dir / "trainer.stopped").write_text(str(time.time()))
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    (config.run_dir / "trainer.slow").write_text("SIGTERM handled")
if name == "trainer-dies-early":  # before it needs the rollout, which is not ready yet
    print("ValueError: could not load the policy", file=sys.stderr)
    sys.exit(3)
address_file = Path(sys.argv[sys.argv.index("--rollout-address-file") + 1])
wait_s = sys.argv[sys.argv.index("--rollout-address-timeout") + 1]  # the worker's, handed on
(config.run_dir / "trainer.wait").write_text(wait_s)
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
    redis_url: str,
    tmp_path: Path,
    *,
    rollout_start_timeout_s: float = 30,
    lease_ttl_s: float = 1.5,
    devices: tuple[str, ...] = ("cpu:0",),
    **worker: object,
) -> AsyncIterator[Mesh]:
    """``worker``: more WorkerSettings fields (or ones to replace the stand-ins')."""
    rollout_script = tmp_path / "stand_in_rollout.py"
    trainer_script = tmp_path / "stand_in_trainer.py"
    rollout_script.write_text(STAND_IN_ROLLOUT)
    trainer_script.write_text(STAND_IN_TRAINER)
    scheduler_settings = SchedulerSettings(
        redis_url=redis_url, port=0, heartbeat_interval_s=0.2, lease_ttl_s=lease_ttl_s
    )
    async with running_scheduler(scheduler_settings, stop_grace_s=0.5) as running:
        identity = running.stores.identity
        settings = WorkerSettings(
            worker_token=await worker_token(identity, worker_id="agent-1"),
            scheduler_address=running.address,
            worker_id="agent-1",
            hostname="testhost",
            run_root=tmp_path / "runs",
            devices=list(devices),
            rollout_command=[sys.executable, str(rollout_script)],
            trainer_command=[sys.executable, str(trainer_script)],
            rollout_start_timeout_s=rollout_start_timeout_s,
            stop_grace_s=2,
            connect_timeout_s=3,
            warm_spares=0,  # the stand-ins have no spare mode (test_warm_spares.py has it)
        ).model_copy(update=worker)
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
    """scheduler_helpers.wait_for_state with a deadline for jobs that start processes."""
    return await scheduler_wait_for_state(stub, job_id, state, timeout_s)


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


async def running_processes(mesh: Mesh, job_id: str, *, ready: str = "trainer.pid") -> list[int]:
    """The pids of the job's first attempt (rollout, trainer), once it is RUNNING and its run
    directory has ``ready``."""
    await wait_for_state(mesh.stub, job_id, common_pb2.JOB_STATE_RUNNING)
    run_dir = mesh.run_root / job_id / "attempt-1"
    await wait_until(lambda: (run_dir / ready).exists())
    return pids(run_dir)
