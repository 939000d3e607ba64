"""Reports from a job's own processes: steps, log lines, result rows, failure reasons, results.

Each method returns True when the reporter should stop (the job ended, was cancelled, or the
report is of an attempt that is no longer current). Steps go to the event stream and to the
job's and tenant's usage (tokens, steps); result rows to the event stream and their generated
tokens to the usage.
"""

from __future__ import annotations

import json
import math
from typing import Any

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.scheduler.jobs.event_log import EventLog
from opentinker.services.scheduler.jobs.job_lifecycle import ACTIVE_STATES
from opentinker.services.scheduler.jobs.job_store import JobStore
from opentinker.services.scheduler.leases.usage import Usage
from opentinker.services.scheduler.tenants.quotas import Quotas

MAX_ROW_BYTES = 16 * 1024  # a result row (ResultRow.json); the job trims its texts to fit
MAX_REPORT_ID = 64  # characters of ReportJobProgressRequest.report_id


class ProgressReports:
    def __init__(self, jobs: JobStore, events: EventLog, quotas: Quotas) -> None:
        self._jobs = jobs
        self._events = events
        self._quotas = quotas

    async def step(
        self, job_id: str, attempt: int, step: common_pb2.StepMetrics, *, report_id: str = ""
    ) -> bool:
        """``report_id``: the same on a resent report, whose usage is then not counted again
        (a store outage may have cut the first short after counting it)."""
        check_report_id(report_id)
        job = await self._current(job_id, attempt)
        if job is None:
            return True
        await self._jobs.record_step(job_id, job.attempt, step)
        await self._quotas.record_step(job, step, report_id=report_id)
        await self._events.append(job_id, common_pb2.JobEvent(step=step))
        return False

    async def log(self, job_id: str, attempt: int, message: str) -> bool:
        if await self._current(job_id, attempt) is None:
            return True
        line = common_pb2.LogLine(message=message)
        await self._events.append(job_id, common_pb2.JobEvent(log=line))
        return False

    async def row(
        self, job_id: str, attempt: int, row: common_pb2.ResultRow, *, report_id: str = ""
    ) -> bool:
        """One inference result row, appended to the event stream as is (never trimmed); its
        tokens counted once per ``report_id``."""
        check_report_id(report_id)
        tokens = check_row(row).get("completion_tokens")
        job = await self._current(job_id, attempt)
        if job is None:
            return True
        await self._events.append(job_id, common_pb2.JobEvent(row=row))
        if isinstance(tokens, int | float) and tokens > 0:
            await self._quotas.record_generated(job, float(tokens), report_id=report_id)
        return False

    async def failure(self, job_id: str, attempt: int, reason: str) -> bool:
        job = await self._current(job_id, attempt)
        if job is None:
            return True
        await self._jobs.record_failure(job_id, job.attempt, reason)
        return False

    async def result(self, job_id: str, attempt: int, result: scheduler_pb2.JobResult) -> bool:
        job = await self._current(job_id, attempt)
        if job is None:
            return True
        await self._jobs.record_result(job_id, job.attempt, result)
        return False

    async def session(
        self,
        job_id: str,
        attempt: int,
        report: scheduler_pb2.SessionReport,
        *,
        report_id: str = "",
    ) -> bool:
        """A session's trainer publishes its endpoint (once serving) and why it ended, with
        the tokens it sampled and trained after its last step report (counted once per
        ``report_id``)."""
        check_report_id(report_id)
        check_tokens(report.tokens_generated, report.tokens_trained)
        job = await self._current(job_id, attempt)
        if job is None:
            return True
        if report.tokens_generated or report.tokens_trained:
            usage = Usage(
                tokens_generated=report.tokens_generated, tokens_trained=report.tokens_trained
            )
            await self._quotas.record_usage(job, usage, report_id=report_id)
        if report.endpoint:
            await self._jobs.set_endpoint(job_id, job.attempt, report.endpoint)
        if report.ended_reason:
            await self._jobs.record_session_end(job_id, job.attempt, report.ended_reason)
        return False

    async def _current(self, job_id: str, attempt: int) -> common_pb2.Job | None:
        """The job if it is active and ``attempt`` (0 = not given) is its current attempt."""
        job = await self._jobs.get(job_id)
        if job.state not in ACTIVE_STATES or (attempt and attempt != job.attempt):
            return None
        return job


def check_report_id(report_id: str) -> None:
    """ConfigError for a report_id longer than MAX_REPORT_ID."""
    if len(report_id) > MAX_REPORT_ID:
        raise ConfigError(
            f"report_id: {len(report_id)} characters, at most {MAX_REPORT_ID}; "
            "send one short id (a uuid) per report",
            reason="BAD_REPORT_ID",
        )


def check_tokens(*counts: float) -> None:
    """ConfigError for a token count that is not a finite number >= 0."""
    if not all(math.isfinite(count) and count >= 0 for count in counts):
        raise ConfigError(
            f"session tokens must be finite and >= 0, got {list(counts)}", reason="BAD_TOKENS"
        )


def check_row(row: common_pb2.ResultRow) -> dict[str, Any]:
    """The row's json, which must be a JSON object of at most MAX_ROW_BYTES (else ConfigError)."""
    size = len(row.json.encode())
    if size > MAX_ROW_BYTES:
        raise ConfigError(
            f"row.json: {size} bytes, over the {MAX_ROW_BYTES} byte limit; trim its texts",
            reason="ROW_TOO_LARGE",
        )
    try:
        parsed = json.loads(row.json)
    except ValueError as err:
        raise ConfigError(f"row.json: not JSON ({err})", reason="BAD_ROW") from err
    if not isinstance(parsed, dict):
        raise ConfigError("row.json: must be a JSON object", reason="BAD_ROW")
    return parsed
