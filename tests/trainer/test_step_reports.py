"""Step reports in the background: the step goes on while the scheduler answers; reports
arrive in order; a stop answer is seen at the next boundary and drops the later reports; a
report that failed raises at the next boundary. A real SchedulerService servicer over gRPC
holds its answers until the test opens a gate."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from async_guard import run

from opentinker.errors import UnavailableError
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel, create_aio_server
from opentinker.services.trainer.reporter import SchedulerReporter
from opentinker.services.trainer.rl.step_reports import BackgroundStepReports

pytestmark = pytest.mark.integration


class GatedScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Answers each ReportJobProgress only once ``gate`` is set; stop from step ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.gate = asyncio.Event()
        self.steps: list[int] = []
        self.stop_at = stop_at

    async def ReportJobProgress(self, request, context):  # noqa: N802 - gRPC method name
        await self.gate.wait()
        self.steps.append(request.step.step)
        stop = self.stop_at is not None and request.step.step >= self.stop_at
        return scheduler_pb2.ReportJobProgressResponse(stop=stop)


async def reports_to(
    servicer: scheduler_pb2_grpc.SchedulerServiceServicer, scenario, *, retry_for_s: float = 0.0
) -> None:
    server, port, _ = create_aio_server(
        ["opentinker.scheduler.v1.SchedulerService"], host="127.0.0.1", port=0
    )
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    await server.start()
    try:
        async with aio_channel(f"127.0.0.1:{port}") as channel:
            reporter = SchedulerReporter(
                channel,
                address=f"127.0.0.1:{port}",
                job_id="j",
                attempt=1,
                timeout_s=5,
                retry_for_s=retry_for_s,
            )
            await scenario(BackgroundStepReports(reporter.report_step, max_pending=8))
    finally:
        await server.stop(grace=0.1)


def test_reports_do_not_block_and_arrive_in_order() -> None:
    servicer = GatedScheduler()

    async def scenario(reports: BackgroundStepReports) -> None:
        for step in range(1, 6):  # the scheduler answers nothing yet: put must not wait
            await asyncio.wait_for(reports.put(step, step, {"reward_mean": 0.5}), 1.0)
            assert not reports.stop_requested
        assert servicer.steps == []
        servicer.gate.set()
        assert await reports.flush() is False
        assert servicer.steps == [1, 2, 3, 4, 5]

    run(lambda: reports_to(servicer, scenario))


def test_a_stop_answer_is_seen_at_the_next_boundary_and_drops_later_reports() -> None:
    servicer = GatedScheduler(stop_at=2)

    async def scenario(reports: BackgroundStepReports) -> None:
        for step in (1, 2, 3, 4):
            await reports.put(step, step, {})
        servicer.gate.set()
        assert await reports.flush() is True
        assert reports.stop_requested
        await reports.put(5, 5, {})  # after the stop: dropped, never sent
        assert await reports.flush() is True
        assert servicer.steps == [1, 2]  # 3 and 4 were queued behind the stop: dropped

    run(lambda: reports_to(servicer, scenario))


def test_a_failed_report_raises_at_the_next_boundary() -> None:
    async def scenario() -> None:
        async with aio_channel("127.0.0.1:9") as channel:  # nothing listens there
            reporter = SchedulerReporter(
                channel, address="127.0.0.1:9", job_id="j", attempt=1, timeout_s=2
            )
            reports = BackgroundStepReports(reporter.report_step)
            await reports.put(1, 1, {})
            with pytest.raises(UnavailableError, match="did not take the job's step report"):
                await reports.flush()
            with pytest.raises(UnavailableError):
                _ = reports.stop_requested

    run(scenario)


class TakesThenDrops(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Takes every report but answers the first UNAVAILABLE, as a scheduler whose Redis went
    away mid-report does (its usage may be counted already): the reporter sends it again."""

    def __init__(self) -> None:
        self.requests: list[scheduler_pb2.ReportJobProgressRequest] = []

    async def ReportJobProgress(self, request, context):  # noqa: N802 - gRPC method name
        self.requests.append(request)
        if len(self.requests) == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Redis went away mid-report")
        return scheduler_pb2.ReportJobProgressResponse()


def test_a_report_sent_again_carries_its_report_id() -> None:
    """The scheduler counts a report's usage once per report_id (test_quotas.py)."""
    servicer = TakesThenDrops()

    async def scenario(reports: BackgroundStepReports) -> None:
        await reports.put(1, 1, {"tokens_generated": 8.0})
        await reports.put(2, 2, {"tokens_generated": 8.0})
        assert await reports.flush() is False

    run(lambda: reports_to(servicer, scenario, retry_for_s=5.0))
    assert [r.step.step for r in servicer.requests] == [1, 1, 2]
    first, again, second = (r.report_id for r in servicer.requests)
    assert first and first == again != second
