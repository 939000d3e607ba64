"""Load on the control plane: many small jobs from many clients of several tenants.

A real scheduler (gRPC + a real redis-server) serves ``--clients`` concurrent SDK-style clients
of 3 tenants, each submitting its share of ``--jobs`` jobs with request ids (a tenth are sent
twice: the retry must return the same job) and cancelling some mid-way. ``--workers`` simulated
workers speak the real ConnectWorker protocol (register, heartbeat, launched, exited) and play
each attempt for ``--job-ms`` (no trainer process: this measures the scheduler, not torch). The
trainer's result report goes through ReportJobProgress with the attempt's job token.

Checked, and printed: every job reaches a terminal state, none is lost or duplicated, no job ran
twice, the devices each tenant holds never exceed its quota at any sampled instant, and every
tenant starts work early (fair share). Figures: jobs/s, submit latency p50/p99, submit ->
RUNNING p50/p99, device-seconds per tenant.

    .venv/bin/python bench/load.py [--jobs 1000] [--clients 20] [--workers 4] [--devices 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import identity_pb2, scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.common.logging import configure_logging
from opentinker.services.launcher.redis_process import RedisProcess
from opentinker.services.scheduler.leases.lease_history import double_leases
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.scheduler.stores import connect_redis
from opentinker.spec import JobSpec, RlConfig, to_proto

TENANTS = {"alpha": 4, "beta": 2, "gamma": 2}  # tenant -> max_devices
TERMINAL = {
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
    common_pb2.JOB_STATE_CANCELLED,
}


@dataclass
class Record:
    tenant: str
    job_id: str
    submitted: float
    submit_latency_s: float


@dataclass
class Figures:
    records: dict[str, Record] = field(default_factory=dict)
    duplicates_returned_same_job: int = 0
    duplicate_submits: int = 0
    cancelled: int = 0
    quota_violations: list[str] = field(default_factory=list)
    samples: int = 0
    launches: dict[tuple[str, int], int] = field(default_factory=dict)
    launched_at: dict[str, float] = field(default_factory=dict)  # job id -> first launch
    double_leases: list[str] = field(default_factory=list)  # from the ledger's history
    redis_commands: int = 0  # what the scheduler asked of Redis during the run


class SimWorker:
    """A worker agent's protocol without processes: each launch runs for ``job_s``."""

    def __init__(self, address: str, token: str, worker_id: str, devices: int, job_s: float):
        self.channel = aio_channel(address, credential=token)
        self.address = address
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self.worker_id = worker_id
        self.devices = [f"{worker_id}/sim:{i}" for i in range(devices)]
        self.job_s = job_s
        self.seq = 0
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()

    async def send(self, call, **payload) -> None:  # noqa: ANN001
        async with self.lock:
            self.seq += 1
            await call.write(scheduler_pb2.ConnectWorkerRequest(seq=self.seq, **payload))

    async def serve(self, figures: Figures, stop: asyncio.Event) -> None:
        call = self.stub.ConnectWorker()
        devices = [scheduler_pb2.Device(device_id=d, kind="sim") for d in self.devices]
        register = scheduler_pb2.RegisterWorker(
            worker_id=self.worker_id, hostname="bench", devices=devices
        )
        await self.send(call, register=register)
        beat = asyncio.create_task(self._beat(call, stop))
        try:
            while not stop.is_set():
                message = await call.read()
                if message is grpc.aio.EOF:
                    return
                if message.HasField("launch"):
                    task = asyncio.create_task(self._play(call, message.launch, figures))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        finally:
            beat.cancel()
            call.cancel()

    async def _beat(self, call, stop: asyncio.Event) -> None:  # noqa: ANN001
        while not stop.is_set():
            await asyncio.sleep(0.2)
            await self.send(call, heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))

    async def _play(self, call, launch: scheduler_pb2.LaunchJob, figures: Figures) -> None:  # noqa: ANN001
        job = launch.job
        key = (job.job_id, job.attempt)
        figures.launches[key] = figures.launches.get(key, 0) + 1
        figures.launched_at.setdefault(job.job_id, time.time())
        await self.send(
            call, launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=job.attempt)
        )
        await asyncio.sleep(self.job_s)
        async with aio_channel(self.address, credential=launch.job_token) as trainer_channel:
            trainer = scheduler_pb2_grpc.SchedulerServiceStub(trainer_channel)
            result = scheduler_pb2.ReportJobProgressRequest(
                job_id=job.job_id, attempt=job.attempt, result=scheduler_pb2.JobResult()
            )
            with contextlib.suppress(grpc.aio.AioRpcError):  # cancelled: its token is revoked
                await trainer.ReportJobProgress(result, timeout=10)
        await self.send(
            call,
            exited=scheduler_pb2.JobExited(job_id=job.job_id, attempt=job.attempt, exit_code=0),
        )


def spec(name: str) -> common_pb2.JobSpec:
    return to_proto(JobSpec(name=name, rl=RlConfig(env_name="letter", steps=1)))


async def client(
    address: str, key: str, tenant: str, n_jobs: int, figures: Figures, rng: random.Random
) -> None:
    async with aio_channel(address, credential=key) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        for i in range(n_jobs):
            request_id = uuid.uuid4().hex
            request = scheduler_pb2.SubmitJobRequest(
                spec=spec(f"{tenant}-{i}"), request_id=request_id
            )
            started = time.monotonic()
            job = (await stub.SubmitJob(request, timeout=30)).job
            figures.records[job.job_id] = Record(
                tenant, job.job_id, time.time(), time.monotonic() - started
            )
            if rng.random() < 0.1:  # a retried submit (lost answer): same job
                figures.duplicate_submits += 1
                again = (await stub.SubmitJob(request, timeout=30)).job
                figures.duplicates_returned_same_job += again.job_id == job.job_id
            if rng.random() < 0.05:
                await asyncio.sleep(rng.random() * 0.05)
                try:
                    await stub.CancelJob(
                        scheduler_pb2.CancelJobRequest(job_id=job.job_id), timeout=30
                    )
                    figures.cancelled += 1
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.FAILED_PRECONDITION:  # already ended
                        raise


async def sample_quotas(running, figures: Figures, stop: asyncio.Event) -> None:  # noqa: ANN001
    """Every 20 ms: the devices each tenant holds (from the ledger) against its quota."""
    while not stop.is_set():
        held = await running.scheduler.devices_in_use()
        figures.samples += 1
        for tenant, count in held.items():
            if count > TENANTS.get(tenant, 0):
                figures.quota_violations.append(f"{tenant} held {count} > {TENANTS[tenant]}")
        await asyncio.sleep(0.02)


async def wait_all_terminal(address: str, key: str, figures: Figures, timeout_s: float) -> dict:
    """Poll every job (as an admin) until all are terminal; returns job_id -> Job."""
    deadline = time.monotonic() + timeout_s
    async with aio_channel(address, credential=key) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        while True:
            jobs = {}
            token = ""
            while True:
                page = await stub.ListJobs(
                    scheduler_pb2.ListJobsRequest(page_size=1000, page_token=token), timeout=30
                )
                jobs.update({j.job_id: j for j in page.jobs})
                if not (token := page.next_page_token):
                    break
            if jobs and all(j.state in TERMINAL for j in jobs.values()):
                return jobs
            if time.monotonic() > deadline:
                left = sum(j.state not in TERMINAL for j in jobs.values())
                raise SystemExit(f"FAIL: {left} jobs not terminal after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)


async def redis_commands(url: str) -> int:
    """Commands the Redis server has processed so far (its INFO stats)."""
    client = connect_redis(url)
    try:
        return int((await client.info("stats"))["total_commands_processed"])
    finally:
        await client.aclose()


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values or [0])[0]


async def main(args: argparse.Namespace) -> int:
    configure_logging("bench", level="WARNING")
    rng = random.Random(0)
    figures = Figures()
    with tempfile.TemporaryDirectory() as tmp, RedisProcess(Path(tmp)) as redis:
        settings = SchedulerSettings(
            redis_url=redis.url,
            port=0,
            heartbeat_interval_s=0.2,
            lease_ttl_s=3.0,
            log_level="WARNING",
        )
        async with running_scheduler(settings, stop_grace_s=0.5) as running:
            identity = running.stores.identity
            keys = {}
            for tenant, max_devices in TENANTS.items():
                await identity.create_tenant(tenant)
                await identity.set_quota(tenant, identity_pb2.TenantQuota(max_devices=max_devices))
                await identity.create_user(f"{tenant}-user", tenant)
                keys[tenant] = (await identity.create_api_key(f"{tenant}-user"))[0]
            await identity.create_tenant("ops")
            await identity.create_user("ops", "ops", role=identity_pb2.ROLE_ADMIN)
            admin_key = (await identity.create_api_key("ops"))[0]
            # a worker token admits one worker id (scheduler/tenants/worker_admission.py): one each
            tokens = [
                (await identity.create_worker_token(worker_id=f"w{i}"))[0]
                for i in range(args.workers)
            ]
            commands_before = await redis_commands(redis.url)
            stop = asyncio.Event()
            workers = [
                SimWorker(running.address, tokens[i], f"w{i}", args.devices, args.job_ms / 1000)
                for i in range(args.workers)
            ]
            serving = [asyncio.create_task(w.serve(figures, stop)) for w in workers]
            sampler = asyncio.create_task(sample_quotas(running, figures, stop))
            # Tenant alpha floods: half the clients; beta and gamma a quarter each.
            tenants = [
                "alpha" if i % 4 < 2 else ("beta" if i % 4 == 2 else "gamma")
                for i in range(args.clients)
            ]
            per_client = args.jobs // args.clients
            started = time.monotonic()
            await asyncio.gather(
                *(client(running.address, keys[t], t, per_client, figures, rng) for t in tenants)
            )
            jobs = await wait_all_terminal(running.address, admin_key, figures, args.timeout_s)
            elapsed = time.monotonic() - started
            stop.set()
            await sampler  # a failed sampler must not pass for a quiet one
            usage = {t.tenant_id: t for t in await running.scheduler.usage(tenant=None)}
            figures.redis_commands = await redis_commands(redis.url) - commands_before
            figures.double_leases = double_leases(await running.stores.ledger.history())
            for task in serving:
                task.cancel()
            await asyncio.gather(*serving, return_exceptions=True)
            await asyncio.sleep(0.5)  # the scheduler notes the workers leaving, before Redis goes
    return report(args, figures, jobs, usage, elapsed)


def summarize(args, figures: Figures, jobs: dict, usage: dict, elapsed: float) -> dict:  # noqa: ANN001
    """The run's figures and invariants, as the SUMMARY line prints them."""
    submitted = len(figures.records)
    states: dict[str, int] = {}
    for job in jobs.values():
        name = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
        states[name] = states.get(name, 0) + 1
    submit_s = [r.submit_latency_s for r in figures.records.values()]
    start_s: dict[str, list[float]] = {t: [] for t in TENANTS}
    for r in figures.records.values():
        if r.job_id in figures.launched_at:
            start_s[r.tenant].append(max(0.0, figures.launched_at[r.job_id] - r.submitted))
    return {
        "jobs": submitted,
        "states": states,
        "elapsed_s": round(elapsed, 2),
        "jobs_per_s": round(submitted / elapsed, 1),
        # What the devices could do at most: every device busy every moment.
        "device_ceiling_jobs_per_s": round(args.workers * args.devices * 1000 / args.job_ms, 1),
        "submit_p50_ms": round(pct(submit_s, 50) * 1e3, 1),
        "submit_p99_ms": round(pct(submit_s, 99) * 1e3, 1),
        "started": {t: len(v) for t, v in start_s.items()},
        "start_p50_s": {t: round(pct(v, 50), 2) for t, v in start_s.items() if v},
        "start_p99_s": {t: round(pct(v, 99), 2) for t, v in start_s.items() if v},
        "device_s": {t: round(u.total.device_seconds, 1) for t, u in usage.items() if t in TENANTS},
        "quota_samples": figures.samples,
        "quota_violations": len(figures.quota_violations),
        "lost": len(set(figures.records) - set(jobs)),
        "unknown": len(set(jobs) - set(figures.records)),
        "ran_twice": len([k for k, n in figures.launches.items() if n > 1])
        + len([j for j in jobs.values() if j.attempt > 1]),
        "double_leases": len(figures.double_leases),
        "redis_commands_per_job": round(figures.redis_commands / max(submitted, 1), 1),
        "retried_submits": figures.duplicate_submits,
        "retries_same_job": figures.duplicates_returned_same_job,
    }


def report(args, figures: Figures, jobs: dict, usage: dict, elapsed: float) -> int:  # noqa: ANN001
    """Print the figures for people and the SUMMARY line; 1 when an invariant broke."""
    sm = summarize(args, figures, jobs, usage, elapsed)
    rate, ceiling = sm["jobs_per_s"], sm["device_ceiling_jobs_per_s"]
    print(
        f"{sm['jobs']} jobs from {args.clients} clients of {len(TENANTS)} tenants, "
        f"{args.workers} workers x {args.devices} devices, {args.job_ms} ms per job"
    )
    print(
        f"  {rate} jobs/s ({rate / ceiling:.0%} of the devices' ceiling {ceiling}/s); "
        f"submit p50 {sm['submit_p50_ms']} ms, p99 {sm['submit_p99_ms']} ms; "
        f"states {sm['states']}"
    )
    for t in TENANTS:
        print(
            f"  {t:>6} (max {TENANTS[t]} devices): {sm['started'][t]} started, submit->launch "
            f"p50 {sm['start_p50_s'].get(t, 0)} s p99 {sm['start_p99_s'].get(t, 0)} s, "
            f"{sm['device_s'].get(t, 0)} device-s"
        )
    print(
        f"  quota samples {sm['quota_samples']}, violations {sm['quota_violations']}; "
        f"lost {sm['lost']}, duplicated {sm['unknown']}, ran twice {sm['ran_twice']}, "
        f"double leases {sm['double_leases']}, Redis commands per job "
        f"{sm['redis_commands_per_job']}, retried submits {sm['retried_submits']} -> same job "
        f"{sm['retries_same_job']}"
    )
    print("SUMMARY " + json.dumps(sm))
    problems = [
        what
        for broken, what in (
            (sm["lost"] or sm["unknown"], "jobs lost or unknown"),
            (sm["double_leases"], f"double leases in the ledger: {figures.double_leases[:3]}"),
            (sm["ran_twice"], "jobs ran more than once"),
            (sm["quota_violations"], f"quota exceeded: {figures.quota_violations[:3]}"),
            (sm["retries_same_job"] != sm["retried_submits"], "a retried submit made a job"),
            (not all(sm["started"].values()), "a tenant never started a job"),
        )
        if broken
    ]
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2, help="devices per worker")
    parser.add_argument("--job-ms", type=int, default=20, help="how long each attempt runs")
    parser.add_argument("--timeout-s", type=float, default=600)
    sys.exit(asyncio.run(main(parser.parse_args())))
