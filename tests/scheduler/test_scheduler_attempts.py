"""Lost attempts: a killed trainer/rollout process re-queues the job (an infrastructure fault),
a failure the trainer reports fails it, and after max_attempts the job fails with the history
of every attempt. Real scheduler (gRPC + Redis), a scripted worker on a real stream."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from async_guard import run
from identity_helpers import worker_token
from scheduler_helpers import (
    ALLOCATING,
    FAILED,
    QUEUED,
    RPC_TIMEOUT_S,
    RUNNING,
    SUCCEEDED,
    Mesh,
    ScriptedWorker,
    job_stub,
    scheduler_mesh,
    scripted_worker,
    states,
    stub_with,
    submit,
    wait_for_state,
    watch_until,
)
from worker_agent_helpers import alive, mesh_with_agent, pids, wait_until
from worker_agent_helpers import run as run_with_processes
from worker_agent_helpers import submit as submit_named

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.common.exit_codes import RETRY_LATER
from opentinker.services.scheduler.jobs.attempts import asks_for_retry, ended_by_signal

pytestmark = pytest.mark.integration


@pytest.mark.unit
@pytest.mark.parametrize(
    ("exit_code", "killed"),
    [(0, False), (1, False), (3, False), (128, False), (-9, True), (-15, True), (-1, True),
     (137, True), (143, True), (192, True), (255, False)],
)  # fmt: skip
def test_which_exit_codes_mean_killed(exit_code: int, killed: bool) -> None:
    assert ended_by_signal(exit_code) is killed


async def launch_and_exit(w: ScriptedWorker, job_id: str, exit_code: int, reason: str) -> int:
    """Take the next launch of ``job_id``, report it running, then exited; its attempt."""
    launch = (await w.next_command()).launch
    assert launch.job.job_id == job_id
    attempt = launch.job.attempt
    await w.send(launched=scheduler_pb2.JobLaunched(job_id=job_id, attempt=attempt))
    await w.send(
        exited=scheduler_pb2.JobExited(
            job_id=job_id, attempt=attempt, exit_code=exit_code, reason=reason
        )
    )
    return attempt


def test_a_killed_trainer_requeues_the_job_and_the_next_attempt_finishes(redis_url: str) -> None:
    killed = "trainer process was killed by signal 9 (SIGKILL) while it trained (see t.log)"

    async def main() -> None:
        async with (
            scheduler_mesh(redis_url) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            job = await submit(mesh.stub)
            assert await launch_and_exit(w, job.job_id, -9, killed) == 1
            launch = (await w.next_command()).launch  # re-queued at once, launched again
            assert (launch.job.job_id, launch.job.attempt) == (job.job_id, 2)
            events = await watch_until(mesh.stub, job.job_id, 5)
            assert states(events) == [QUEUED, ALLOCATING, RUNNING, QUEUED, ALLOCATING]
            assert events[3].state_change.reason == f"{killed}; re-queued"
            await w.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=2))
            await wait_for_state(mesh.stub, job.job_id, RUNNING)
            await job_stub(mesh, launch).ReportJobProgress(
                scheduler_pb2.ReportJobProgressRequest(
                    job_id=job.job_id, attempt=2, result=scheduler_pb2.JobResult()
                ),
                timeout=RPC_TIMEOUT_S,
            )
            await w.send(exited=scheduler_pb2.JobExited(job_id=job.job_id, attempt=2, exit_code=0))
            done = await wait_for_state(mesh.stub, job.job_id, SUCCEEDED)
            assert done.attempt == 2

    run(main)


def test_after_max_attempts_the_job_fails_with_each_attempts_reason(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:  # max_attempts: the default, 3
            async with scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                job = await submit(mesh.stub)
                await launch_and_exit(w1, job.job_id, -9, "trainer killed by signal 9")
                await launch_and_exit(w1, job.job_id, 143, "")  # SIGTERM'd from outside
                launch = (await w1.next_command()).launch
                assert launch.job.attempt == 3
                await w1.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=3))
                await wait_for_state(mesh.stub, job.job_id, RUNNING)
            # w1's stream is gone with attempt 3 on it: no fourth attempt
            failed = await wait_for_state(mesh.stub, job.job_id, FAILED)
            assert failed.reason == (
                "gave up after 3 attempts: 1: trainer killed by signal 9; "
                "2: a process of the attempt was killed (exit code 143); 3: worker w1 lost"
            )
            assert await mesh.running.stores.queue.list_ids() == []
            assert await mesh.running.stores.ledger.leases("w1") == []

    run(main)


async def launch_and_report_failure(
    mesh: Mesh,
    w: ScriptedWorker,
    job_id: str,
    reason: str,
) -> scheduler_pb2.LaunchJob:
    """Take attempt 1's launch, report it running, then report its failure as its trainer
    does (with the job's token); the launch."""
    launch = (await w.next_command()).launch
    await w.send(launched=scheduler_pb2.JobLaunched(job_id=job_id, attempt=1))
    await job_stub(mesh, launch).ReportJobProgress(
        scheduler_pb2.ReportJobProgressRequest(
            job_id=job_id, attempt=1, failure=scheduler_pb2.JobFailure(reason=reason)
        ),
        timeout=RPC_TIMEOUT_S,
    )
    return launch


def test_a_failure_the_trainer_reports_is_not_retried(redis_url: str) -> None:
    async def main() -> None:
        async with (
            scheduler_mesh(redis_url) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            job = await submit(mesh.stub)
            launch = await launch_and_report_failure(
                mesh, w, job.job_id, "env 'letters' is not registered"
            )
            await w.send(
                exited=scheduler_pb2.JobExited(
                    job_id=launch.job.job_id, attempt=1, exit_code=1, reason="ignored"
                )
            )
            failed = await wait_for_state(mesh.stub, job.job_id, FAILED)
            assert failed.reason == "env 'letters' is not registered" and failed.attempt == 1
            with pytest.raises(TimeoutError):  # no second launch
                await w.next_command(timeout_s=0.5)

    run(main)


def test_a_trainer_that_asks_to_retry_later_is_requeued_with_its_reason(redis_url: str) -> None:
    """A storage fault with on_storage_error=requeue: the trainer reports why and exits
    RETRY_LATER; the job goes back to the queue (a lost attempt), the reason kept."""
    full = "disk full: could not write checkpoint /ckpt/j/step-000004 (...); 0 B free of 2 GiB"
    assert asks_for_retry(RETRY_LATER) and not ended_by_signal(RETRY_LATER)

    async def main() -> None:
        async with (
            scheduler_mesh(redis_url) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            job = await submit(mesh.stub)
            await launch_and_report_failure(mesh, w, job.job_id, full)
            await w.send(
                exited=scheduler_pb2.JobExited(
                    job_id=job.job_id, attempt=1, exit_code=RETRY_LATER, reason="a log line"
                )
            )
            again = (await w.next_command()).launch  # re-queued at once, launched again
            assert (again.job.job_id, again.job.attempt) == (job.job_id, 2)
            events = await watch_until(mesh.stub, job.job_id, 5)
            assert states(events) == [QUEUED, ALLOCATING, RUNNING, QUEUED, ALLOCATING]
            assert events[3].state_change.reason == f"{full}; re-queued"

    run(main)


def test_an_exit_from_a_worker_not_running_the_attempt_changes_nothing(redis_url: str) -> None:
    """w2, on a token bound to w2, reports that w1's attempt exited (failed, killed, done): the
    job runs on, and w1's own exit still decides it."""

    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            w2_token = await worker_token(mesh.running.stores.identity, worker_id="w2")
            async with (
                scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1,
                scripted_worker(stub_with(mesh, w2_token), "w2", ["w2/cpu:0"]) as w2,
            ):
                job = await submit(mesh.stub, "on-w1")
                launch = (await w1.next_command()).launch
                await w1.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
                await wait_for_state(mesh.stub, job.job_id, RUNNING)
                other = await submit(mesh.stub, "on-w2")
                assert (await w2.next_command()).launch.job.job_id == other.job_id
                for code in (1, -9, 0):
                    exited = scheduler_pb2.JobExited(job_id=job.job_id, attempt=1, exit_code=code)
                    await w2.send(exited=exited)
                # w2's stream is read in order: once its own job runs, the exits were handled
                await w2.send(launched=scheduler_pb2.JobLaunched(job_id=other.job_id, attempt=1))
                await wait_for_state(mesh.stub, other.job_id, RUNNING)
                still = await wait_for_state(mesh.stub, job.job_id, RUNNING)
                assert (still.attempt, still.worker_id) == (1, "w1")
                leases = await mesh.running.stores.ledger.leases("w1")
                assert [lease.job_id for lease in leases] == [job.job_id]
                await job_stub(mesh, launch).ReportJobProgress(
                    scheduler_pb2.ReportJobProgressRequest(
                        job_id=job.job_id, attempt=1, result=scheduler_pb2.JobResult()
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
                await w1.send(exited=scheduler_pb2.JobExited(job_id=job.job_id, attempt=1))
                await wait_for_state(mesh.stub, job.job_id, SUCCEEDED)

    run(main)


def test_the_worker_reports_a_sigkilled_trainer_or_rollout_and_the_job_runs_again(
    redis_url: str, tmp_path: Path
) -> None:
    """The real worker agent and real processes (the stand-ins of worker_agent_helpers)."""

    async def main() -> None:
        async with mesh_with_agent(redis_url, tmp_path) as mesh:
            job = await submit_named(mesh.stub, "hang")
            first = mesh.run_root / job.job_id / "attempt-1"
            # RUNNING: the rollout serves and the trainer trains (both start at once before)
            await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
            await wait_until(lambda: (first / "trainer.pid").exists())
            rollout_pid, trainer_pid = pids(first)
            os.kill(trainer_pid, signal.SIGKILL)
            second = mesh.run_root / job.job_id / "attempt-2"
            await wait_until(lambda: (second / "trainer.pid").exists())
            assert not alive(rollout_pid)  # the attempt's rollout went with it
            running = await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_RUNNING)
            assert running.attempt == 2
            events = await watch_until(mesh.stub, job.job_id, 5)
            reason = events[3].state_change.reason
            assert reason.startswith("trainer process was killed by signal 9 (SIGKILL)"), reason
            assert reason.endswith("; re-queued") and "attempt-1/trainer.log" in reason
            # the rollout killed: the same, one attempt more
            await wait_until(lambda: (second / "rollout.pid").exists())
            os.kill(pids(second)[0], signal.SIGKILL)
            await wait_until(lambda: (mesh.run_root / job.job_id / "attempt-3").exists())
            reason = (await watch_until(mesh.stub, job.job_id, 8))[6].state_change.reason
            assert reason.startswith("rollout process was killed by signal 9 (SIGKILL) while the")
            await mesh.stub.CancelJob(
                scheduler_pb2.CancelJobRequest(job_id=job.job_id), timeout=RPC_TIMEOUT_S
            )

    run_with_processes(main)
