"""Progress reports to the scheduler (SchedulerService.ReportJobProgress)."""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from opentinker.common.v1 import common_pb2
from opentinker.errors import UnavailableError
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc


class SchedulerReporter:
    """Reports one job attempt's steps, result or failure; each call has a deadline."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        address: str,
        job_id: str,
        attempt: int,
        timeout_s: float,
    ) -> None:
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self._address = address
        self._job_id = job_id
        self._attempt = attempt
        self._timeout_s = timeout_s

    async def report_step(
        self, step: int, policy_version: int, metrics: Mapping[str, float]
    ) -> bool:
        """Report one step's metrics; True when the scheduler says stop (cancelled/superseded)."""
        pb = common_pb2.StepMetrics(step=step, policy_version=policy_version, metrics=dict(metrics))
        return await self._report(scheduler_pb2.ReportJobProgressRequest(step=pb))

    async def report_result(self, checkpoint_uri: str, final_metrics: Mapping[str, float]) -> None:
        result = scheduler_pb2.JobResult(
            checkpoint_uri=checkpoint_uri, final_metrics=dict(final_metrics)
        )
        await self._report(scheduler_pb2.ReportJobProgressRequest(result=result))

    async def report_failure(self, reason: str) -> None:
        failure = scheduler_pb2.JobFailure(reason=reason)
        await self._report(scheduler_pb2.ReportJobProgressRequest(failure=failure))

    async def report_log(self, message: str) -> bool:
        """A line for the job's event stream; True when the scheduler says stop."""
        return await self._report(
            scheduler_pb2.ReportJobProgressRequest(log=common_pb2.LogLine(message=message))
        )

    async def _report(self, request: scheduler_pb2.ReportJobProgressRequest) -> bool:
        request.job_id = self._job_id
        request.attempt = self._attempt
        try:
            reply = await self._stub.ReportJobProgress(request, timeout=self._timeout_s)
        except grpc.RpcError as err:
            code = err.code().name if err.code() is not None else "UNKNOWN"
            raise UnavailableError(
                f"scheduler at {self._address} did not take the job's "
                f"{request.WhichOneof('payload')} report: {code}: {err.details()}",
                code=code,
            ) from err
        return reply.stop
