"""A launch waits for the earlier runs on its devices (services/worker/device_handover.py).

The whole path (an orphaned attempt still stopping when its job comes back to the same device)
runs against the real scheduler in tests/test_worker_agent.py; these pin what the waiting
does with a stop that comes meanwhile and with runs on other devices.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from opentinker.common.v1 import common_pb2
from opentinker.services.worker.device_handover import holders_of, run_when_free
from opentinker.services.worker.held import HeldRun
from opentinker.services.worker.job_run import JobRun
from opentinker.services.worker.settings import WorkerSettings


def _run(tmp_path: Path, job_id: str, devices: list[str]) -> JobRun:
    async def launched() -> None:
        raise AssertionError("never launched")

    return JobRun(
        common_pb2.Job(job_id=job_id, attempt=1),
        lease_id=f"lease-{job_id}",
        device_ids=devices,
        job_token="",
        settings=WorkerSettings(run_root=tmp_path, worker_id="w", devices=devices),
        on_launched=launched,
    )


def test_only_runs_on_a_shared_device_are_waited_for(tmp_path: Path) -> None:
    async def main() -> None:
        forever = asyncio.create_task(asyncio.sleep(3600))
        runs = {
            ("a", 1): HeldRun(_run(tmp_path, "a", ["h/cuda:0", "h/cuda:1"]), forever),
            ("b", 1): HeldRun(_run(tmp_path, "b", ["h/cuda:2"]), forever),
        }
        assert [h.run.job.job_id for h in holders_of(["h/cuda:1"], runs)] == ["a"]
        assert [h.run.job.job_id for h in holders_of(["h/cuda:2", "h/cuda:3"], runs)] == ["b"]
        assert holders_of(["h/cuda:3"], runs) == []
        forever.cancel()

    asyncio.run(main())


def test_a_stop_while_waiting_ends_the_attempt_unstarted_and_leaves_the_holder_running(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        holder_task = asyncio.create_task(asyncio.sleep(3600))
        holder = HeldRun(_run(tmp_path, "old", ["h/cuda:0"]), holder_task)
        new = _run(tmp_path, "new", ["h/cuda:0"])
        waiting = asyncio.create_task(run_when_free(new, [holder]))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the old run still holds the device
        new.stop("cancelled by the user")
        outcome = await asyncio.wait_for(waiting, 5)
        assert (outcome.exit_code, outcome.reason) == (-1, "stopped: cancelled by the user")
        assert not (new.run_dir / "launch.json").exists()  # nothing was started
        assert not holder_task.done()  # waiting never cancels the holder
        holder_task.cancel()

    asyncio.run(main())
