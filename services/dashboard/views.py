"""What the pages show, gathered from the scheduler and EnvHub with the user's own key."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

from opentinker.client import Client
from opentinker.connection import Connection
from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc
from opentinker.jobs import JobEvent, JobInfo


@dataclass(frozen=True)
class JobRow:
    """One line of the jobs page."""

    job: JobInfo
    steps_done: int  # the last step reported (GetJobsProgress)
    device_seconds: float  # all attempts (GetUsage)
    reward: float | None  # the last step's mean reward, or the final one

    @property
    def progress(self) -> float | None:
        """Fraction of the step budget done, 0..1; None without a budget."""
        budget = self.job.step_budget
        return min(self.steps_done / budget, 1.0) if budget else None

    @property
    def created(self) -> str:
        return dt.datetime.fromtimestamp(self.job.created_unix_s, dt.UTC).strftime("%m-%d %H:%M")


def job_rows(client: Client, *, limit: int = 100) -> list[JobRow]:
    """The caller's jobs, newest first, with their last step and usage (device-seconds)."""
    jobs = []
    for job in client.list_jobs():
        jobs.append(job)
        if len(jobs) >= limit:
            break
    usage = {u.job_id: u.usage for t in client.usage(max_jobs=limit) for u in t.jobs}
    progress = client.jobs_progress([job.job_id for job in jobs])
    rows = []
    for job in jobs:
        used, last = usage.get(job.job_id), progress.get(job.job_id)
        reward = last.metrics.get("reward_mean") if last else None
        rows.append(
            JobRow(
                job=job,
                steps_done=last.step if last else 0,
                device_seconds=used.device_seconds if used else 0.0,
                reward=job.final_metrics.get("reward_mean", reward),
            )
        )
    return rows


def environments(
    address: str, *, api_key: str, ca_file: str | None, timeout: float
) -> list[envhub_pb2.EnvironmentInstance]:
    """Every environment instance EnvHub lets the caller see, with its health."""
    conn = Connection(address, api_key=api_key, timeout=timeout, ca_file=ca_file)
    try:
        stub = envhub_pb2_grpc.EnvHubServiceStub(conn.channel)
        request = envhub_pb2.ListEnvironmentsRequest(page_size=100)
        return list(conn.pages(stub.ListEnvironments, request, "instances", None))
    finally:
        conn.close()


def event_json(event: JobEvent) -> dict[str, Any]:
    """An event as the job page's script reads it (the SDK's JobEvent fields), a non-finite
    number (a diverged step's NaN loss) as None: the browser's JSON.parse throws on the NaN
    and Infinity that ``json.dumps`` writes, and the page would drop the whole event."""
    return _finite_or_none(dataclasses.asdict(event))


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(item) for item in value]
    return value
