"""The scheduler's test harness: a real scheduler (gRPC + Redis) with a user's and a worker's
stubs, job helpers (submit, get, wait for a state, watch), and ScriptedWorker, a real
ConnectWorker client written in the test, so every message the scheduler must react to can be
sent exactly when the test wants it. Used by the scheduler's, the worker agent's and the
trainer reporter's tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from identity_helpers import api_key, worker_token

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.scheduler.server import RunningScheduler, running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.spec import JobSpec, RlConfig, to_proto

QUEUED = common_pb2.JOB_STATE_QUEUED
ALLOCATING = common_pb2.JOB_STATE_ALLOCATING
RUNNING = common_pb2.JOB_STATE_RUNNING
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED
FAILED = common_pb2.JOB_STATE_FAILED
CANCELLED = common_pb2.JOB_STATE_CANCELLED

RPC_TIMEOUT_S = 5.0


class WorkerStubs:
    """The workers' side of a mesh: a worker token admits one worker id (the first that
    registers with it; scheduler/tenants/worker_admission.py), so each worker id a test connects
    gets
    a stub of its own, holding one of a few tokens made when the mesh starts."""

    def __init__(self, stubs: list[scheduler_pb2_grpc.SchedulerServiceStub]) -> None:
        self._free = stubs
        self._by_worker: dict[str, scheduler_pb2_grpc.SchedulerServiceStub] = {}

    def for_worker(self, worker_id: str) -> scheduler_pb2_grpc.SchedulerServiceStub:
        if worker_id not in self._by_worker:
            assert self._free, "more worker ids than WORKER_TOKENS in one mesh"
            self._by_worker[worker_id] = self._free.pop(0)
        return self._by_worker[worker_id]


WORKER_TOKENS = 4  # distinct worker ids one mesh's tests may connect


@dataclass
class Mesh:
    running: RunningScheduler
    stub: scheduler_pb2_grpc.SchedulerServiceStub  # a user's (tenant acme)
    worker_stub: WorkerStubs  # worker tokens', one per worker id
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
        worker_channels = [
            aio_channel(running.address, credential=await worker_token(identity))
            for _ in range(WORKER_TOKENS)
        ]
        try:
            yield Mesh(
                running,
                scheduler_pb2_grpc.SchedulerServiceStub(channel),
                WorkerStubs([scheduler_pb2_grpc.SchedulerServiceStub(c) for c in worker_channels]),
                channels := [channel, *worker_channels],
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
        if isinstance(stub, WorkerStubs):
            stub = stub.for_worker(worker_id)
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


async def report_result(mesh: Mesh, launch: scheduler_pb2.LaunchJob) -> None:
    """The trainer reports its result to the new scheduler (nothing tied it to the old one)."""
    result = scheduler_pb2.ReportJobProgressRequest(
        job_id=launch.job.job_id,
        attempt=1,
        result=scheduler_pb2.JobResult(checkpoint_uri="file:///ckpt"),
    )
    trainer = job_stub(mesh, launch)
    assert not (await trainer.ReportJobProgress(result, timeout=RPC_TIMEOUT_S)).stop
