"""The scheduler as a real gRPC server on Redis, driven by real gRPC clients: jobs without
workers (validation, idempotent submit, cancel), then with scripted workers (run, fail, cancel,
revoked tokens, disconnects, missed heartbeats). Harness: scheduler_helpers.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from async_guard import run
from identity_helpers import worker_token
from scheduler_helpers import (
    ALLOCATING,
    CANCELLED,
    FAILED,
    QUEUED,
    RPC_TIMEOUT_S,
    RUNNING,
    SUCCEEDED,
    ScriptedWorker,
    get_job,
    job_stub,
    scheduler_mesh,
    scripted_worker,
    spec,
    states,
    stub_with,
    submit,
    wait_for_state,
    watch,
    watch_until,
)

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2

pytestmark = pytest.mark.integration


# ---- jobs without workers ---------------------------------------------------------------------


def test_invalid_spec_is_rejected_naming_the_field(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            bad = spec()
            bad.rl.steps = -5
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await mesh.stub.SubmitJob(
                    scheduler_pb2.SubmitJobRequest(spec=bad), timeout=RPC_TIMEOUT_S
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "rl.steps" in info.value.details()
            listed = await mesh.stub.ListJobs(
                scheduler_pb2.ListJobsRequest(), timeout=RPC_TIMEOUT_S
            )
            assert list(listed.jobs) == []

    run(main)


def test_unknown_job_is_not_found(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            calls = [
                mesh.stub.GetJob(scheduler_pb2.GetJobRequest(job_id="x"), timeout=RPC_TIMEOUT_S),
                mesh.stub.CancelJob(
                    scheduler_pb2.CancelJobRequest(job_id="x"), timeout=RPC_TIMEOUT_S
                ),
                watch(mesh.stub, "x"),
            ]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                assert info.value.details() == "job 'x' not found"

    run(main)


def test_submit_is_idempotent_on_request_id_and_jobs_list_newest_first(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            request = scheduler_pb2.SubmitJobRequest(spec=spec("first"), request_id="req-42")
            one = (await mesh.stub.SubmitJob(request, timeout=RPC_TIMEOUT_S)).job
            two = (await mesh.stub.SubmitJob(request, timeout=RPC_TIMEOUT_S)).job
            assert one.job_id == two.job_id and one.state == QUEUED
            later = await submit(mesh.stub, "second")
            page = await mesh.stub.ListJobs(
                scheduler_pb2.ListJobsRequest(page_size=1), timeout=RPC_TIMEOUT_S
            )
            assert [j.job_id for j in page.jobs] == [later.job_id]
            rest = await mesh.stub.ListJobs(
                scheduler_pb2.ListJobsRequest(page_size=1, page_token=page.next_page_token),
                timeout=RPC_TIMEOUT_S,
            )
            assert [j.job_id for j in rest.jobs] == [one.job_id]
            assert rest.next_page_token == ""
            # Only one QUEUED event for the repeated submit.
            assert await mesh.running.stores.events.last_seq(one.job_id) == 1

    run(main)


def test_cancel_a_queued_job(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            job = await submit(mesh.stub)
            assert await mesh.running.stores.queue.list_ids() == [job.job_id]
            cancelled = (
                await mesh.stub.CancelJob(
                    scheduler_pb2.CancelJobRequest(job_id=job.job_id, reason="changed my mind"),
                    timeout=RPC_TIMEOUT_S,
                )
            ).job
            assert cancelled.state == CANCELLED and cancelled.reason == "changed my mind"
            assert await mesh.running.stores.queue.list_ids() == []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await mesh.stub.CancelJob(
                    scheduler_pb2.CancelJobRequest(job_id=job.job_id), timeout=RPC_TIMEOUT_S
                )
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # The watch replays and ends at the terminal state.
            events = await watch(mesh.stub, job.job_id)
            assert states(events) == [QUEUED, CANCELLED]
            assert [e.seq for e in events] == [1, 2]

    run(main)


# ---- with workers -----------------------------------------------------------------------------


def test_job_runs_on_a_worker_and_succeeds_with_its_result(redis_url: str) -> None:
    async def main() -> None:
        async with (
            scheduler_mesh(redis_url) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            job = await submit(mesh.stub, "good")
            live = asyncio.create_task(watch(mesh.stub, job.job_id))
            message = await w.next_command()
            assert message.HasField("launch")
            launch = message.launch
            assert launch.job.job_id == job.job_id and launch.job.attempt == 1
            assert list(launch.device_ids) == ["w1/cpu:0"] and launch.lease_id
            assert (await get_job(mesh.stub, job.job_id)).state == ALLOCATING
            await w.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
            await wait_for_state(mesh.stub, job.job_id, RUNNING)

            report = scheduler_pb2.ReportJobProgressRequest(
                job_id=job.job_id,
                attempt=1,
                step=common_pb2.StepMetrics(step=1, metrics={"reward": 0.5}),
            )
            # Only the attempt's own job token may report, never a user's key.
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await mesh.stub.ReportJobProgress(report, timeout=RPC_TIMEOUT_S)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            trainer = job_stub(mesh, launch)
            assert not (await trainer.ReportJobProgress(report, timeout=RPC_TIMEOUT_S)).stop
            result = scheduler_pb2.ReportJobProgressRequest(
                job_id=job.job_id,
                attempt=1,
                result=scheduler_pb2.JobResult(
                    checkpoint_uri="file:///ckpt/final", final_metrics={"reward": 0.9}
                ),
            )
            assert not (await trainer.ReportJobProgress(result, timeout=RPC_TIMEOUT_S)).stop
            # The token is of attempt 1: it cannot speak for another attempt.
            stale = scheduler_pb2.ReportJobProgressRequest(
                job_id=job.job_id, attempt=7, log=common_pb2.LogLine(message="old")
            )
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await trainer.ReportJobProgress(stale, timeout=RPC_TIMEOUT_S)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED

            await w.send(exited=scheduler_pb2.JobExited(job_id=job.job_id, attempt=1, exit_code=0))
            done = await wait_for_state(mesh.stub, job.job_id, SUCCEEDED)
            assert done.checkpoint_uri == "file:///ckpt/final"
            assert done.tenant_id == "acme" and done.owner_user_id == "alice"
            # The attempt is over: its token is revoked.
            with pytest.raises(grpc.aio.AioRpcError) as revoked:
                await trainer.ReportJobProgress(report, timeout=RPC_TIMEOUT_S)
            assert revoked.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert dict(done.final_metrics) == {"reward": 0.9}

            events = await asyncio.wait_for(live, RPC_TIMEOUT_S)
            assert states(events) == [QUEUED, ALLOCATING, RUNNING, SUCCEEDED]
            assert [e.step.metrics["reward"] for e in events if e.HasField("step")] == [0.5]
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            # A late watcher from seq 3 replays the rest of the history.
            assert [e.seq for e in await watch(mesh.stub, job.job_id, from_seq=3)] == [3, 4, 5]
            assert await mesh.running.stores.ledger.free_devices("w1") == ["w1/cpu:0"]

    run(main)


def test_failed_exit_uses_the_reported_reason_then_the_workers(redis_url: str) -> None:
    async def main() -> None:
        async with (
            scheduler_mesh(redis_url) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            first = await submit(mesh.stub, "a")
            second = await submit(mesh.stub, "b")
            for job, reported, worker_reason, expected in (
                (first, "loss became NaN at step 3", "ignored", "loss became NaN at step 3"),
                (second, "", "", "trainer exited with code 2"),
            ):
                launch = (await w.next_command()).launch
                assert launch.job.job_id == job.job_id
                await w.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
                if reported:
                    await job_stub(mesh, launch).ReportJobProgress(
                        scheduler_pb2.ReportJobProgressRequest(
                            job_id=job.job_id,
                            attempt=1,
                            failure=scheduler_pb2.JobFailure(reason=reported),
                        ),
                        timeout=RPC_TIMEOUT_S,
                    )
                await w.send(
                    exited=scheduler_pb2.JobExited(
                        job_id=job.job_id, attempt=1, exit_code=2, reason=worker_reason
                    )
                )
                failed = await wait_for_state(mesh.stub, job.job_id, FAILED)
                assert failed.reason == expected

    run(main)


def test_cancelling_a_running_job_stops_it_and_frees_its_lease_once_it_exited(
    redis_url: str,
) -> None:
    async def main() -> None:
        async with (
            scheduler_mesh(redis_url) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w,
        ):
            job = await submit(mesh.stub)
            trainer = job_stub(mesh, (await w.next_command()).launch)
            await w.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
            await wait_for_state(mesh.stub, job.job_id, RUNNING)
            ledger = mesh.running.stores.ledger
            assert await ledger.free_devices("w1") == []

            await mesh.stub.CancelJob(
                scheduler_pb2.CancelJobRequest(job_id=job.job_id, reason="enough"),
                timeout=RPC_TIMEOUT_S,
            )
            stop = await w.next_command()
            assert stop.HasField("stop") and stop.stop.job_id == job.job_id
            assert stop.stop.reason == "enough"
            assert (await get_job(mesh.stub, job.job_id)).state == CANCELLED
            # Its processes may still run: the device stays held (draining) until they exit.
            [draining] = await ledger.leases("w1")
            assert draining.drain is not None and draining.drain.reason == "enough"
            assert await ledger.free_devices("w1") == []
            # The cancelled attempt's token is revoked: its reporter learns to stop.
            progress = scheduler_pb2.ReportJobProgressRequest(
                job_id=job.job_id, attempt=1, step=common_pb2.StepMetrics(step=2)
            )
            with pytest.raises(grpc.aio.AioRpcError) as revoked:
                await trainer.ReportJobProgress(progress, timeout=RPC_TIMEOUT_S)
            assert revoked.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # The worker's exit report frees the device and does not change a cancelled job.
            await w.send(
                exited=scheduler_pb2.JobExited(
                    job_id=job.job_id, attempt=1, exit_code=-15, reason="stopped"
                )
            )
            await asyncio.sleep(0.3)
            assert await ledger.free_devices("w1") == ["w1/cpu:0"]
            final = await get_job(mesh.stub, job.job_id)
            assert final.state == CANCELLED and final.reason == "enough"

    run(main)


def test_a_job_placed_while_its_cancel_was_under_way_is_stopped_and_its_lease_drained(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CancelJob read the job QUEUED; before it wrote CANCELLED the dispatcher placed the job on
    a worker that had just connected. The cancel must still stop that attempt and hold its
    lease only until the worker reports its exit, not wait for the worker to report a launch
    it was never told to drop."""
    from opentinker.services.scheduler.jobs.job_store import RedisJobStore

    transition = RedisJobStore.transition

    async def main() -> None:
        async with scheduler_mesh(redis_url, lease_ttl_s=30.0) as mesh:
            job = await submit(mesh.stub, "raced")
            worker = ScriptedWorker(mesh.worker_stub, "w1", ["w1/cpu:0"])

            async def placed_meanwhile(self, job_id: str, to: int, **kwargs):  # noqa: ANN001, ANN202
                if to == CANCELLED:  # the cancel has read the job: a worker comes, takes it
                    await worker.connect()
                    assert (await worker.next_command()).launch.job.job_id == job_id
                return await transition(self, job_id, to, **kwargs)

            monkeypatch.setattr(RedisJobStore, "transition", placed_meanwhile)
            try:
                await mesh.stub.CancelJob(
                    scheduler_pb2.CancelJobRequest(job_id=job.job_id, reason="enough"),
                    timeout=RPC_TIMEOUT_S,
                )
                stop = (await worker.next_command()).stop
                assert (stop.job_id, stop.reason) == (job.job_id, "enough")
                exited = scheduler_pb2.JobExited(job_id=job.job_id, attempt=1, exit_code=-15)
                await worker.send(exited=exited)
                await asyncio.sleep(0.3)
                assert await mesh.running.stores.ledger.leases("w1") == []
            finally:
                await worker.disconnect()

    run(main)


def test_a_worker_whose_token_is_revoked_is_cut_off_and_its_job_requeued(redis_url: str) -> None:
    """Revoking a worker token must end the stream it opened, not only refuse the next one:
    else a worker an admin cut off keeps receiving jobs and their tokens."""
    from opentinker.auth import parse_credential

    async def main() -> None:
        async with scheduler_mesh(redis_url, lease_ttl_s=30.0) as mesh:
            identity = mesh.running.stores.identity
            token = await worker_token(identity)
            async with scripted_worker(stub_with(mesh, token), "w1", ["w1/cpu:0"]) as w:
                job = await submit(mesh.stub)
                await w.next_command()
                await w.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
                await wait_for_state(mesh.stub, job.job_id, RUNNING)
                await identity.revoke(parse_credential(token)[1])
                stop = await w.next_command()
                assert (stop.stop.job_id, stop.stop.attempt) == (job.job_id, 1)
                closing = await w.next_command()
                assert "revoked" in closing.closing.reason
                requeued = await wait_for_state(mesh.stub, job.job_id, QUEUED)
                assert requeued.attempt == 1
                # Its processes may still run: the lease is kept draining (until it lapses, or
                # the worker, back, reports their exit), and the worker's devices withdrawn.
                [lease] = await mesh.running.stores.ledger.leases("w1")
                assert lease.drain is not None and "lost" in lease.drain.reason
                assert await mesh.running.stores.ledger.free_devices("w1") == []

    run(main)


def test_a_disconnected_workers_job_is_requeued_and_resumes_elsewhere(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            async with scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1:
                job = await submit(mesh.stub)
                await w1.next_command()
                await w1.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
                await wait_for_state(mesh.stub, job.job_id, RUNNING)
            # w1's stream is gone.
            requeued = await wait_for_state(mesh.stub, job.job_id, QUEUED)
            assert requeued.reason == "worker w1 lost; re-queued"
            assert requeued.attempt == 1 and requeued.worker_id == ""
            assert await mesh.running.stores.ledger.leases("w1") == []
            async with scripted_worker(mesh.worker_stub, "w2", ["w2/cpu:0"]) as w2:
                launch = (await w2.next_command()).launch
                assert launch.job.job_id == job.job_id and launch.job.attempt == 2
            events = [e for e in await watch_until(mesh.stub, job.job_id, 5)]
            assert states(events)[:5] == [QUEUED, ALLOCATING, RUNNING, QUEUED, ALLOCATING]

    run(main)


def test_a_worker_that_stops_heartbeating_loses_its_job(redis_url: str) -> None:
    async def main() -> None:
        async with (
            scheduler_mesh(redis_url, lease_ttl_s=0.6) as mesh,
            scripted_worker(mesh.worker_stub, "w1", ["w1/cpu:0"]) as w1,
        ):
            job = await submit(mesh.stub)
            await w1.next_command()
            await w1.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
            await wait_for_state(mesh.stub, job.job_id, RUNNING)
            await asyncio.sleep(1.0)  # heartbeats keep it running well past the TTL
            assert (await get_job(mesh.stub, job.job_id)).state == RUNNING
            w1.heartbeating = False
            requeued = await wait_for_state(mesh.stub, job.job_id, QUEUED, timeout_s=5)
            assert requeued.reason.startswith("worker w1 lost: no heartbeat for ")
            assert requeued.reason.endswith(" s; re-queued")
            closing = await w1.next_command()
            assert closing.HasField("closing") and "no heartbeat" in closing.closing.reason

    run(main)
