"""The trainer's progress reports ride out a scheduler restart: retried in order, none lost.

A real scheduler (gRPC + Redis) is stopped and started again on the same port while the
reporter keeps reporting; the job's event stream must hold every step once, in order.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from async_guard import run
from identity_helpers import api_key, worker_token
from scheduler_helpers import RUNNING, scripted_worker, submit, wait_for_state
from structlog.testing import capture_logs

from opentinker.errors import UnavailableError
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.launcher.redis_process import free_port
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.trainer.reporter import SchedulerReporter

pytestmark = pytest.mark.integration


def test_step_reports_wait_out_a_scheduler_restart_in_order(redis_url: str) -> None:
    async def main() -> None:
        settings = SchedulerSettings(
            redis_url=redis_url,
            port=free_port(),
            heartbeat_interval_s=0.2,
            lease_ttl_s=1.0,
            reconnect_grace_s=30,
        )
        address = f"127.0.0.1:{settings.port}"
        async with running_scheduler(settings, stop_grace_s=0.5) as first:
            identity = first.stores.identity
            channel = aio_channel(address, credential=await api_key(identity))
            worker_channel = aio_channel(address, credential=await worker_token(identity))
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            worker_stub = scheduler_pb2_grpc.SchedulerServiceStub(worker_channel)
            async with scripted_worker(worker_stub, "w1", ["w1/cpu:0"]) as worker:
                job = await submit(stub, "reports")
                token = (await worker.next_command()).launch.job_token
                await worker.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
                await wait_for_state(stub, job.job_id, RUNNING)
            # The trainer's channel, holding the attempt's job token (kept in Redis: it is
            # still good after the restart).
            job_channel = aio_channel(address, credential=token)
            reporter = SchedulerReporter(
                job_channel,
                address=address,
                job_id=job.job_id,
                attempt=1,
                timeout_s=2,
                retry_for_s=30,
            )
            assert not await reporter.report_step(1, 1, {"reward": 0.1})
        # The scheduler is down: the next reports wait for it instead of failing the job.
        reports = asyncio.create_task(report_steps(reporter, range(2, 6)))
        await asyncio.sleep(1.0)
        assert not reports.done()
        async with running_scheduler(settings, stop_grace_s=0.5):
            assert await asyncio.wait_for(reports, 20) == [False] * 4
            await reporter.report_result("file:///ckpt", {"reward": 0.5})
            request = scheduler_pb2.WatchJobRequest(job_id=job.job_id)
            call = stub.WatchJob(request, timeout=5)
            events = []
            async for response in call:
                events.append(response.event)
                if response.event.HasField("step") and response.event.step.step == 5:
                    call.cancel()
                    break
        for c in (channel, worker_channel, job_channel):
            await c.close()
        steps = [e.step.step for e in events if e.HasField("step")]
        assert steps == [1, 2, 3, 4, 5]
        seqs = [e.seq for e in events]
        assert seqs == sorted(seqs)

    run(main, 60)


async def report_steps(reporter: SchedulerReporter, steps: range) -> list[bool]:
    return [await reporter.report_step(step, step, {"reward": step / 10}) for step in steps]


def test_a_scheduler_away_longer_than_the_retry_budget_fails_the_report(tmp_path: Path) -> None:
    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"  # nothing listens there
        async with aio_channel(address) as channel:
            reporter = SchedulerReporter(
                channel, address=address, job_id="job-x", attempt=1, timeout_s=1, retry_for_s=1.0
            )
            with capture_logs() as logs, pytest.raises(UnavailableError) as info:
                await reporter.report_step(1, 1, {})
        assert info.value.code == "UNAVAILABLE"
        assert "step report (retried 1 s)" in info.value.message
        retries = [entry for entry in logs if entry["event"] == "report_retry"]
        assert len(retries) >= 2 and retries[0]["payload"] == "step"

    run(main)
