"""Progress reports to the scheduler (SchedulerService.ReportJobProgress).

The job's processes outlive a scheduler restart (the worker keeps them running), so a report
that finds the scheduler UNAVAILABLE — restarting, or its Redis is — is retried with backoff
for up to ``retry_for_s`` before the job gives up; while the scheduler answers that its Redis
lost its state (reason STATE_LOST, scheduler/lost_state.py) it is retried until an operator
restores or re-bootstraps (then the job's token is unknown, and the worker stops the job).
Reports are sent one at a time, so steps arrive in order and none is skipped; the RL loop
sends its step reports from a background task (step_reports.py), so training goes on
meanwhile. Only UNAVAILABLE is retried. The scheduler
may still have taken part of such a report (its Redis went away between the report's writes)
or all of it (the answer was lost on a dropped connection): every resend carries the report's
``report_id``, so the usage it carries is counted once; its event may, rarely, show twice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.errors import (
    STATE_LOST_REASON,
    OpenTinkerError,
    UnavailableError,
    from_rpc_error,
)
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)


class SchedulerReporter:
    """Reports one job attempt's steps, result or failure; each call has a deadline
    (``timeout_s``), and an UNAVAILABLE scheduler is retried for ``retry_for_s`` in all."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        address: str,
        job_id: str,
        attempt: int,
        timeout_s: float,
        retry_for_s: float = 0.0,
        backoff_max_s: float = 2.0,
    ) -> None:
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self._address = address
        self._job_id = job_id
        self._attempt = attempt
        self._timeout_s = timeout_s
        self._retry_for_s = retry_for_s
        self._backoff_max_s = backoff_max_s
        self._log = log.bind(job_id=job_id, attempt=attempt, scheduler=address)

    async def report_step(
        self,
        step: int,
        policy_version: int,
        metrics: Mapping[str, float],
        env_error_reason: str = "",
    ) -> bool:
        """Report one step's metrics (and its first env error's reason, '' = none); True when
        the scheduler says stop (cancelled/superseded)."""
        pb = common_pb2.StepMetrics(
            step=step,
            policy_version=policy_version,
            metrics=dict(metrics),
            env_error_reason=env_error_reason,
        )
        return await self._report(scheduler_pb2.ReportJobProgressRequest(step=pb))

    async def report_result(self, checkpoint_uri: str, final_metrics: Mapping[str, float]) -> None:
        result = scheduler_pb2.JobResult(
            checkpoint_uri=checkpoint_uri, final_metrics=dict(final_metrics)
        )
        await self._report(scheduler_pb2.ReportJobProgressRequest(result=result))

    async def report_failure(self, reason: str) -> None:
        failure = scheduler_pb2.JobFailure(reason=reason)
        await self._report(scheduler_pb2.ReportJobProgressRequest(failure=failure))

    async def report_row(self, row: Mapping[str, Any]) -> bool:
        """One result row of an inference job; True when the scheduler says stop."""
        pb = common_pb2.ResultRow(json=json.dumps(row, ensure_ascii=False), index=row["index"])
        return await self._report(scheduler_pb2.ReportJobProgressRequest(row=pb))

    async def report_session(
        self,
        *,
        endpoint: str = "",
        ended_reason: str = "",
        tokens_generated: float = 0.0,
        tokens_trained: float = 0.0,
    ) -> bool:
        """A session job: where its TrainerService serves, or why it ended and the tokens it
        sampled and trained after its last step report."""
        report = scheduler_pb2.SessionReport(
            endpoint=endpoint,
            ended_reason=ended_reason,
            tokens_generated=tokens_generated,
            tokens_trained=tokens_trained,
        )
        return await self._report(scheduler_pb2.ReportJobProgressRequest(session=report))

    async def report_log(self, message: str) -> bool:
        """A line for the job's event stream; True when the scheduler says stop."""
        return await self._report(
            scheduler_pb2.ReportJobProgressRequest(log=common_pb2.LogLine(message=message))
        )

    async def _report(self, request: scheduler_pb2.ReportJobProgressRequest) -> bool:
        request.job_id = self._job_id
        request.attempt = self._attempt
        request.report_id = uuid.uuid4().hex  # the same on every resend: counted once
        give_up_at = time.monotonic() + self._retry_for_s
        delay = min(0.1, self._backoff_max_s)
        while True:
            try:
                reply = await self._stub.ReportJobProgress(request, timeout=self._timeout_s)
                return reply.stop
            except grpc.RpcError as err:
                code = err.code().name if err.code() is not None else "UNKNOWN"
                lost = from_rpc_error(err).reason == STATE_LOST_REASON
                if lost:
                    # Nothing re-queued the job: wait for the operator (restore or
                    # re-bootstrap), as the worker does; the budget counts from the last such
                    # answer.
                    give_up_at = time.monotonic() + self._retry_for_s
                if code != "UNAVAILABLE" or (not lost and time.monotonic() + delay > give_up_at):
                    waited = "" if code != "UNAVAILABLE" else f" (retried {self._retry_for_s:g} s)"
                    raise UnavailableError(
                        f"scheduler at {self._address} did not take the job's "
                        f"{request.WhichOneof('payload')} report{waited}: {code}: {err.details()}",
                        code=code,
                    ) from err
                self._log.warning(
                    "report_retry", payload=request.WhichOneof("payload"), retry_in_s=delay
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff_max_s)


async def report_failure_logged(
    reporter: Any, reason: str, job_log: Any, *, event: str = "job_failed", **context: Any
) -> None:
    """Log why the job failed and report it to the scheduler. A report that cannot be made is
    logged, not raised: the process exits failed either way and the worker reports its exit."""
    job_log.error(event, reason=reason, **context)
    try:
        await reporter.report_failure(reason)
    except OpenTinkerError as err:
        job_log.error("failure_not_reported", error=str(err))
