"""A private rollout and its trainer start at the same time (worker/job_run.py): the trainer
reads the rollout's address from rollout.addr when it needs it. Every way that start can go
wrong still ends the attempt with its reason and leaves no process behind.

Through the real worker agent and scheduler (gRPC + Redis) with worker_agent_helpers.py's stand-in
rollout and trainer (what each does is chosen by the job's name), and once with the real
services through the mesh and the tiny model.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest
from worker_agent_helpers import (
    RPC_TIMEOUT_S,
    alive,
    device_freed,
    mesh_with_agent,
    pids,
    run,
    submit,
    wait_for_state,
    wait_until,
)

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.common.launch import write_atomic
from opentinker.services.common.logging import parse_log_line
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.trainer.errors import RolloutError
from opentinker.services.trainer.rollout_link.rollout_address import RolloutAddress
from opentinker.services.worker.job_run import TRAINER_WAIT_GRACE_S

pytestmark = pytest.mark.integration

FAILED = common_pb2.JOB_STATE_FAILED


@pytest.mark.unit
def test_the_trainer_reads_the_address_once_the_rollout_writes_it(tmp_path: Path) -> None:
    given = RolloutAddress.given("127.0.0.1:7", tmp_path / "rollout.addr")
    assert given == RolloutAddress(address="127.0.0.1:7")  # a known address wins
    assert RolloutAddress.given(None, None) is None  # SFT: no rollout
    later = RolloutAddress.given(None, tmp_path / "rollout.addr")
    assert later is not None

    async def main() -> str:
        waiting = asyncio.create_task(later.resolve(default_timeout_s=10))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # the rollout has not written it yet
        write_atomic(tmp_path / "rollout.addr", "127.0.0.1:9\n")
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(main()) == "127.0.0.1:9"


@pytest.mark.unit
def test_the_trainers_own_wait_ends_with_a_clear_reason_or_at_once_when_cancelled(
    tmp_path: Path,
) -> None:
    never = RolloutAddress(file=tmp_path / "rollout.addr")
    with pytest.raises(RolloutError, match=r"the rollout did not write rollout.addr within 1 s"):
        asyncio.run(never.resolve(default_timeout_s=1))

    async def cancelled() -> float:  # the trainer's SIGTERM cancels its task mid-wait
        waiting = asyncio.create_task(never.resolve(default_timeout_s=600))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return time.monotonic() - started

    assert asyncio.run(cancelled()) < 1.0

    # The wait the worker handed over (--rollout-address-timeout) wins over the default.
    handed = RolloutAddress.given(None, tmp_path / "rollout.addr", timeout_s=0.5)
    assert handed is not None
    started = time.monotonic()
    with pytest.raises(RolloutError, match=r"within 0 s"):
        asyncio.run(handed.resolve(default_timeout_s=600))
    assert time.monotonic() - started < 5


@pytest.mark.unit
def test_a_rollout_addr_without_an_address_is_named(tmp_path: Path) -> None:
    """Not a gRPC error about an unreachable target later: what the file holds, and whose."""
    for garbage in ("", "not an address", "127.0.0.1", "localhost:port"):
        write_atomic(tmp_path / "rollout.addr", garbage + "\n")
        with pytest.raises(RolloutError, match=r"not the rollout's host:port"):
            asyncio.run(RolloutAddress(file=tmp_path / "rollout.addr").resolve(default_timeout_s=1))
    for good in ("127.0.0.1:50051", "[::1]:7", "unix:/tmp/r.sock", "node-3.local:9"):
        write_atomic(tmp_path / "rollout.addr", good + "\n")
        resolved = RolloutAddress(file=tmp_path / "rollout.addr").resolve(default_timeout_s=1)
        assert asyncio.run(resolved) == good


@pytest.mark.unit
def test_a_rollout_addr_with_a_port_no_server_can_bind_is_named(tmp_path: Path) -> None:
    """Port 0 or one past 65535 is no rollout's address: the same error as garbage, naming what
    the file holds, not a gRPC error about an unreachable target later."""
    for address in ("127.0.0.1:0", "127.0.0.1:65536", "[::1]:99999"):
        write_atomic(tmp_path / "rollout.addr", address + "\n")
        named = re.escape(f"holds {address!r}, not the rollout's host:port")
        with pytest.raises(RolloutError, match=named):
            asyncio.run(RolloutAddress(file=tmp_path / "rollout.addr").resolve(default_timeout_s=1))
    write_atomic(tmp_path / "rollout.addr", "127.0.0.1:65535\n")
    resolved = RolloutAddress(file=tmp_path / "rollout.addr").resolve(default_timeout_s=1)
    assert asyncio.run(resolved) == "127.0.0.1:65535"


def test_the_trainer_is_started_before_the_rollout_is_ready(redis_url: str, tmp_path: Path) -> None:
    """The stand-in rollout of "beside-good" writes rollout.addr only once the worker has
    started the trainer: a worker that started the trainer after the rollout's address (as it
    once did) would leave it waiting in vain, and the attempt would fail."""

    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path) as mesh:
            job = await submit(mesh.stub, "beside-good")
            await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_SUCCEEDED)
            run_dir = mesh.run_root / job.job_id / "attempt-1"
            # The trainer read the address from the file the rollout wrote after it started.
            assert (run_dir / "trainer.env").read_text() == "|127.0.0.1:1"
            rollout_pid, _ = pids(run_dir)
            await wait_until(lambda: not alive(rollout_pid))

    run(main)


def test_a_rollout_dying_before_it_is_ready_ends_the_trainer_started_beside_it(
    redis_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path) as mesh:
            job = await submit(mesh.stub, "beside-rollout-dies")  # once the trainer runs
            failed = await wait_for_state(mesh.stub, job.job_id, FAILED)
            assert "rollout process died with exit code 4 before it was ready" in failed.reason
            assert "RuntimeError: the engine failed while the trainer started" in failed.reason
            run_dir = mesh.run_root / job.job_id / "attempt-1"
            assert not any(alive(pid) for pid in pids(run_dir))
            assert not (run_dir / "trainer.env").exists()  # it never got an address
            assert await device_freed(mesh)

    run(main)


def test_a_trainer_dying_or_killed_before_the_rollout_is_ready_ends_the_rollout(
    redis_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path) as mesh:
            job = await submit(mesh.stub, "trainer-dies-early")  # its rollout is never ready
            failed = await wait_for_state(mesh.stub, job.job_id, FAILED)
            assert failed.reason == "ValueError: could not load the policy"
            run_dir = mesh.run_root / job.job_id / "attempt-1"
            assert not (run_dir / "rollout.addr").exists()
            await wait_until(lambda: not any(alive(pid) for pid in pids(run_dir)))
            assert await device_freed(mesh)

            # Killed while it waits for its rollout: an infrastructure fault, re-queued.
            job = await submit(mesh.stub, "never-ready")
            run_dir = mesh.run_root / job.job_id / "attempt-1"
            await wait_until(lambda: (run_dir / "trainer.pid").exists())
            rollout_pid, trainer_pid = pids(run_dir)
            os.kill(trainer_pid, signal.SIGKILL)
            await wait_until(lambda: not alive(rollout_pid))
            await wait_until(lambda: (run_dir.parent / "attempt-2").exists())
            request = scheduler_pb2.WatchJobRequest(job_id=job.job_id)
            reasons = []
            async for reply in mesh.stub.WatchJob(request, timeout=RPC_TIMEOUT_S):
                reasons.append(reply.event.state_change.reason)
                if reasons[-1].endswith("; re-queued"):
                    break
            assert reasons[-1].startswith(
                "trainer process was killed by signal 9 (SIGKILL) while its rollout started"
            ), reasons
            await mesh.stub.CancelJob(
                scheduler_pb2.CancelJobRequest(job_id=job.job_id), timeout=RPC_TIMEOUT_S
            )
            await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_CANCELLED)

    run(main)


def test_a_rollout_never_ready_fails_each_attempt_in_time_and_ends_its_trainer(
    redis_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        # 5 s, not less: the stand-in trainer must have started (a Python process) before the
        # rollout's start times out, or it never writes trainer.wait (2 s failed at load 8).
        async with mesh_with_agent(redis_url, tmp_path, rollout_start_timeout_s=5) as mesh:
            job = await submit(mesh.stub, "never-ready")
            # A late rollout is an infrastructure fault: re-queued, then failed after 3 attempts.
            failed = await wait_for_state(mesh.stub, job.job_id, FAILED, timeout_s=60)
            assert failed.reason.startswith("gave up after 3 attempts: ")
            assert "1: rollout did not write rollout.addr within 5 s" in failed.reason
            # The trainer was told to wait longer than the worker, so the worker's reason won.
            waits = [
                mesh.run_root / job.job_id / f"attempt-{attempt}" / "trainer.wait"
                for attempt in (1, 2, 3)
            ]
            told = [float(w.read_text()) for w in waits if w.exists()]
            assert told and set(told) == {5 + TRAINER_WAIT_GRACE_S}, told
            for attempt in (1, 2, 3):
                run_dir = mesh.run_root / job.job_id / f"attempt-{attempt}"
                assert not any(alive(pid) for pid in pids(run_dir)), attempt
            assert await device_freed(mesh)

    run(main)


def test_cancelling_a_job_whose_rollout_is_not_ready_ends_both(
    redis_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path) as mesh:
            job = await submit(mesh.stub, "never-ready")
            run_dir = mesh.run_root / job.job_id / "attempt-1"
            await wait_until(lambda: (run_dir / "trainer.pid").exists())
            processes = pids(run_dir)
            assert all(alive(pid) for pid in processes)
            await mesh.stub.CancelJob(
                scheduler_pb2.CancelJobRequest(job_id=job.job_id, reason="user stop"),
                timeout=RPC_TIMEOUT_S,
            )
            await wait_until(lambda: not any(alive(pid) for pid in processes))
            cancelled = await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_CANCELLED)
            assert cancelled.reason == "user stop"
            assert await device_freed(mesh)

    run(main)


def _timestamp(line: str) -> float:
    parsed = parse_log_line(line)
    assert parsed is not None, line
    return parsed[0]


def _first(path: Path, *needles: str) -> str:
    for line in path.read_text().splitlines():
        if all(n in line for n in needles):
            return line
    raise AssertionError(f"no line with {needles} in {path}")


@pytest.mark.slow
def test_the_real_trainer_starts_while_the_real_rollout_is_starting(
    tmp_path: Path, letter_model_dir: Path
) -> None:
    """Cold processes (no spares): the worker starts the trainer before the rollout serves,
    and the trainer then reads the rollout's address from rollout.addr."""
    rl = RlConfig(
        env_name="letter",
        env_options={"num_letters": "4"},
        steps=1,
        prompts_per_step=2,
        samples_per_prompt=2,
        sampling=SamplingParams(max_new_tokens=1),
    )
    spec = JobSpec(name="start", model=ModelSpec(base_model=str(letter_model_dir)), rl=rl)
    with (
        LocalMesh(MeshSettings(run_root=tmp_path, warm_spares=0)) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client,
    ):
        job = client.fit(spec, timeout=300)
        assert job.state == "SUCCEEDED", job.reason
        run_dir = mesh.run_root / "jobs" / job.job_id / "attempt-1"
        worker_log = mesh.log_dir / "worker.log"
        started = {
            name: _timestamp(_first(worker_log, "process_started", f"name='{name}'", job.job_id))
            for name in ("rollout", "trainer")
        }
        serving = _timestamp(_first(run_dir / "rollout.log", "event='rollout_serving'"))
        assert started["rollout"] <= started["trainer"] < serving
        address = _first(run_dir / "trainer.log", "event='rollout_address'")
        assert (run_dir / "rollout.addr").read_text().strip() in address
