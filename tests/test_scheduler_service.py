"""The scheduler as a real gRPC server on Redis, driven by real gRPC clients.

The worker side here is a plain ConnectWorker client written in the test, so every message the
scheduler must react to can be sent exactly when the test wants it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
from async_guard import run
from identity_helpers import api_key, worker_token

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.scheduler.server import RunningScheduler, running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.spec import JobSpec, RlConfig, to_proto

pytestmark = pytest.mark.integration

QUEUED = common_pb2.JOB_STATE_QUEUED
ALLOCATING = common_pb2.JOB_STATE_ALLOCATING
RUNNING = common_pb2.JOB_STATE_RUNNING
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED
FAILED = common_pb2.JOB_STATE_FAILED
CANCELLED = common_pb2.JOB_STATE_CANCELLED

RPC_TIMEOUT_S = 5.0


@dataclass
class Mesh:
    running: RunningScheduler
    stub: scheduler_pb2_grpc.SchedulerServiceStub  # a user's (tenant acme)
    worker_stub: scheduler_pb2_grpc.SchedulerServiceStub  # a worker token's
    channels: list[grpc.aio.Channel]  # closed when the mesh stops


@asynccontextmanager
async def scheduler_mesh(
    redis_url: str, *, lease_ttl_s: float = 1.0, **settings_fields: object
) -> AsyncIterator[Mesh]:
    settings_fields.setdefault("reconnect_grace_s", 0.0)  # lost workers are re-queued at once
    settings_fields.setdefault("port", 0)
    settings = SchedulerSettings(
        redis_url=redis_url,
        heartbeat_interval_s=0.2,
        lease_ttl_s=lease_ttl_s,
        **settings_fields,  # type: ignore[arg-type]
    )
    async with running_scheduler(settings, stop_grace_s=0.5) as running:
        identity = running.stores.identity
        channel = aio_channel(running.address, credential=await api_key(identity))
        worker_channel = aio_channel(running.address, credential=await worker_token(identity))
        try:
            yield Mesh(
                running,
                scheduler_pb2_grpc.SchedulerServiceStub(channel),
                scheduler_pb2_grpc.SchedulerServiceStub(worker_channel),
                channels := [channel, worker_channel],
            )
        finally:
            for c in channels:
                await c.close()


def spec(name: str = "job", num_devices: int = 1, priority: int = 0) -> common_pb2.JobSpec:
    return to_proto(
        JobSpec(
            name=name,
            rl=RlConfig(env_name="letters", steps=3),
            num_devices=num_devices,
            priority=priority,
        )
    )


async def submit(stub, name: str = "job", **kwargs) -> common_pb2.Job:
    request = scheduler_pb2.SubmitJobRequest(spec=spec(name, **kwargs))
    return (await stub.SubmitJob(request, timeout=RPC_TIMEOUT_S)).job


async def get_job(stub, job_id: str) -> common_pb2.Job:
    return (
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=RPC_TIMEOUT_S)
    ).job


async def wait_for_state(stub, job_id: str, state: int, timeout_s: float = 8.0) -> common_pb2.Job:
    deadline = time.monotonic() + timeout_s
    while True:
        job = await get_job(stub, job_id)
        if job.state == state:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(
                f"job {job_id} is {common_pb2.JobState.Name(job.state)} ({job.reason}), "
                f"expected {common_pb2.JobState.Name(state)}"
            )
        await asyncio.sleep(0.05)


async def watch(stub, job_id: str, from_seq: int = 0) -> list[common_pb2.JobEvent]:
    request = scheduler_pb2.WatchJobRequest(job_id=job_id, from_seq=from_seq)
    return [r.event async for r in stub.WatchJob(request, timeout=RPC_TIMEOUT_S)]


def job_stub(
    mesh: Mesh, launch: scheduler_pb2.LaunchJob
) -> scheduler_pb2_grpc.SchedulerServiceStub:
    """A stub holding the attempt's job token, as the job's trainer does."""
    assert launch.job_token.startswith("otj_")
    mesh.channels.append(aio_channel(mesh.running.address, credential=launch.job_token))
    return scheduler_pb2_grpc.SchedulerServiceStub(mesh.channels[-1])


def stub_with(mesh: Mesh, credential: str) -> scheduler_pb2_grpc.SchedulerServiceStub:
    """A SchedulerService stub sending ``credential`` (closed with the mesh)."""
    mesh.channels.append(aio_channel(mesh.running.address, credential=credential))
    return scheduler_pb2_grpc.SchedulerServiceStub(mesh.channels[-1])


def states(events: list[common_pb2.JobEvent]) -> list[int]:
    return [e.state_change.state for e in events if e.HasField("state_change")]


class ScriptedWorker:
    """A real ConnectWorker client that heartbeats and records what the scheduler sends."""

    def __init__(self, stub, worker_id: str, devices: list[str]) -> None:
        self.worker_id = worker_id
        self.devices = devices
        self.call = stub.ConnectWorker()
        self.seq = 0
        self.heartbeating = True
        self._heartbeats: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()  # gRPC allows one write in flight per call

    async def send(self, **payload) -> None:
        async with self._write_lock:
            self.seq += 1
            await self.call.write(scheduler_pb2.ConnectWorkerRequest(seq=self.seq, **payload))

    async def connect(
        self, held: list[scheduler_pb2.HeldAttempt] | None = None
    ) -> scheduler_pb2.WorkerRegistered:
        await self.send(
            register=scheduler_pb2.RegisterWorker(
                worker_id=self.worker_id,
                hostname="test",
                devices=[scheduler_pb2.Device(device_id=d, kind="cpu") for d in self.devices],
                held=held or [],
            )
        )
        first = await asyncio.wait_for(self.call.read(), RPC_TIMEOUT_S)
        assert first.seq == 1 and first.HasField("registered")
        self._heartbeats = asyncio.create_task(self._beat())
        return first.registered

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if self.heartbeating:
                await self.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))

    async def next_command(self, timeout_s: float = 5.0) -> scheduler_pb2.ConnectWorkerResponse:
        """The next message that is not a heartbeat."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = await asyncio.wait_for(
                self.call.read(), max(deadline - time.monotonic(), 0.01)
            )
            assert message is not grpc.aio.EOF, "the scheduler ended the stream"
            if not message.HasField("heartbeat"):
                return message

    async def disconnect(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        self.call.cancel()


@asynccontextmanager
async def scripted_worker(
    stub, worker_id: str, devices: list[str], held: list[scheduler_pb2.HeldAttempt] | None = None
) -> AsyncIterator[ScriptedWorker]:
    worker = ScriptedWorker(stub, worker_id, devices)
    await worker.connect(held)
    try:
        yield worker
    finally:
        with contextlib.suppress(Exception):
            await worker.disconnect()


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


def test_cancelling_a_running_job_stops_it_and_frees_its_lease(redis_url: str) -> None:
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
            assert await ledger.free_devices("w1") == ["w1/cpu:0"]
            # The cancelled attempt's token is revoked: its reporter learns to stop.
            progress = scheduler_pb2.ReportJobProgressRequest(
                job_id=job.job_id, attempt=1, step=common_pb2.StepMetrics(step=2)
            )
            with pytest.raises(grpc.aio.AioRpcError) as revoked:
                await trainer.ReportJobProgress(progress, timeout=RPC_TIMEOUT_S)
            assert revoked.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # The worker's exit report does not change a cancelled job.
            await w.send(
                exited=scheduler_pb2.JobExited(
                    job_id=job.job_id, attempt=1, exit_code=-15, reason="stopped"
                )
            )
            await asyncio.sleep(0.3)
            final = await get_job(mesh.stub, job.job_id)
            assert final.state == CANCELLED and final.reason == "enough"

    run(main)


def test_a_job_placed_while_its_cancel_was_under_way_is_stopped_and_its_lease_freed(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CancelJob read the job QUEUED; before it wrote CANCELLED the dispatcher placed the job on
    a worker that had just connected. The cancel must still stop that attempt and free its
    lease, not wait for the worker to report a launch it was never told to drop."""
    from opentinker.services.scheduler.job_store import RedisJobStore

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
                assert await mesh.running.stores.ledger.leases("w1") == []

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
            assert requeued.reason == "worker w1 lost; re-queued"
            closing = await w1.next_command()
            assert closing.HasField("closing") and "no heartbeat" in closing.closing.reason

    run(main)


async def watch_until(stub, job_id: str, count: int) -> list[common_pb2.JobEvent]:
    """The first ``count`` events of a job that has not ended yet."""
    out = []
    call = stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job_id), timeout=RPC_TIMEOUT_S)
    async for response in call:
        out.append(response.event)
        if len(out) == count:
            call.cancel()
            break
    return out
