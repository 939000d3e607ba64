"""A launch waits for the earlier runs on its devices (services/worker/device_handover.py).

The whole path (an orphaned attempt still stopping when its job comes back to the same device)
runs against the real scheduler in tests/worker/test_worker_agent.py; these pin what the waiting
does with a stop that comes meanwhile and with runs on other devices.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.worker import device_handover
from opentinker.services.worker.device_handover import holders_of, run_when_free
from opentinker.services.worker.held import HeldRun
from opentinker.services.worker.job_run import JobRun
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.shared_rollouts import SharedRollouts


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
        ended = asyncio.create_task(asyncio.sleep(0))
        runs = {
            ("a", 1): HeldRun(_run(tmp_path, "a", ["h/cuda:0", "h/cuda:1"]), forever),
            ("b", 1): HeldRun(_run(tmp_path, "b", ["h/cuda:2"]), forever),
            ("c", 1): HeldRun(_run(tmp_path, "c", ["h/cuda:3"]), ended),
        }
        await ended

        def holders(devices: list[str]) -> list[str]:
            return sorted(holders_of(_run(tmp_path, "new", devices), runs, None))

        assert holders(["h/cuda:1"]) == ["a/1"]
        assert holders(["h/cuda:0", "h/cuda:2"]) == ["a/1", "b/1"]
        assert holders(["h/cuda:3"]) == []  # its run has ended
        assert holders(["h/cuda:4"]) == []
        forever.cancel()

    asyncio.run(main())


def test_a_stop_while_waiting_ends_the_attempt_unstarted_and_leaves_the_holder_running(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        holder_task = asyncio.create_task(asyncio.sleep(3600))
        new = _run(tmp_path, "new", ["h/cuda:0"])
        said: list[object] = []

        async def say(**payload: object) -> None:
            said.append(payload["waiting"])

        waiting = asyncio.create_task(run_when_free(new, {"old/1": holder_task}, say=say))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the old run still holds the device
        assert said == [
            scheduler_pb2.JobWaiting(
                job_id="new",
                attempt=1,
                reason="waiting for its devices (h/cuda:0), still held here by old/1",
            )
        ]
        new.stop("cancelled by the user")
        outcome = await asyncio.wait_for(waiting, 5)
        assert (outcome.exit_code, outcome.reason) == (-1, "stopped: cancelled by the user")
        assert not (new.run_dir / "launch.json").exists()  # nothing was started
        assert not holder_task.done()  # waiting never cancels the holder
        holder_task.cancel()

    asyncio.run(main())


STAND_IN_SHARED_ROLLOUT = """
import signal, sys, time
from pathlib import Path
from opentinker.services.common.launch import write_atomic
# A second to stop, as a rollout releasing its GPU does
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), sys.exit(0)))
write_atomic(Path(sys.argv[sys.argv.index("--addr-file") + 1]), "127.0.0.1:1")
time.sleep(3600)
"""


def _job(
    job_id: str, finetune: common_pb2.FinetuneMode, base_model: str = "base-a"
) -> common_pb2.Job:
    job = common_pb2.Job(job_id=job_id, attempt=1)
    job.spec.kind = common_pb2.JOB_KIND_RL
    job.spec.model.base_model = base_model
    job.spec.model.finetune = finetune
    return job


def test_a_gpu_job_waits_for_the_shared_rollout_its_starter_left_on_the_device(
    tmp_path: Path,
) -> None:
    """Job a (LoRA) started the shared rollout on cuda:0 and ended; b, on cuda:1, still uses
    it. A LoRA job of its base placed on cuda:0 joins it and does not wait; a full fine-tuning
    job there waits until the rollout's process has exited (b left, then its 1 s stop). While
    a job waits the rollout takes no new jobs, so the wait ends with the jobs it has, and a
    LoRA job it would now refuse waits too."""
    script = tmp_path / "shared_rollout.py"
    script.write_text(STAND_IN_SHARED_ROLLOUT)
    settings = WorkerSettings(
        run_root=tmp_path,
        worker_id="w",
        devices=["cuda:0", "cuda:1"],
        rollout_command=[sys.executable, str(script)],
        shared_lora_capacity=4,
        stop_grace_s=5,
    )

    def job_run(job_id: str, finetune: common_pb2.FinetuneMode, base: str = "base-a") -> JobRun:
        run = _run(tmp_path, job_id, ["h/cuda:0"])
        run.job.CopyFrom(_job(job_id, finetune, base_model=base))
        return run

    async def main() -> None:
        shared = SharedRollouts(settings, env=dict(os.environ))
        lora, full_ft = common_pb2.FINETUNE_MODE_LORA, common_pb2.FINETUNE_MODE_FULL
        assert await shared.join("a", "base-a", device_ids=["h/cuda:0"]) is not None
        assert await shared.join("b", "base-a", device_ids=["h/cuda:1"]) is not None
        await shared.leave("a", "base-a")  # the rollout lives on for b, on a's GPU
        assert holders_of(job_run("e", lora), {}, shared) == {}  # it would join the rollout
        assert holders_of(_run(tmp_path, "d", ["h/cuda:2"]), {}, shared) == {}  # another GPU
        rollout = ["shared rollout of base-a"]
        assert sorted(holders_of(job_run("f", lora, base="base-b"), {}, shared)) == rollout

        full = job_run("c", full_ft)
        holders = holders_of(full, {}, shared)
        assert sorted(holders) == rollout
        waiting = asyncio.create_task(full.until_done(list(holders.values())))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        # Closed meanwhile: a new job gets a private rollout, and one on cuda:0 waits as well.
        assert await shared.join("g", "base-a", device_ids=["h/cuda:3"]) is None
        assert shared.serving("base-a") == ["b"]
        assert sorted(holders_of(job_run("e", lora), {}, shared)) == rollout
        leaving = asyncio.create_task(shared.leave("b", "base-a"))  # the last job out
        await asyncio.sleep(0.5)
        assert not waiting.done()  # the rollout is still stopping (its 1 s)
        assert sorted(holders_of(job_run("h", full_ft), {}, shared)) == rollout
        await leaving
        assert await asyncio.wait_for(waiting, 5) is True
        assert holders_of(full, {}, shared) == {}
        assert await shared.join("g", "base-a", device_ids=["h/cuda:3"]) is not None  # anew
        assert shared.serving("base-a") == ["g"]
        await shared.close()

    asyncio.run(main())


def test_a_shared_rollout_that_dies_frees_the_jobs_waiting_for_its_gpu(tmp_path: Path) -> None:
    script = tmp_path / "shared_rollout.py"
    script.write_text(STAND_IN_SHARED_ROLLOUT)
    settings = WorkerSettings(
        run_root=tmp_path,
        worker_id="w",
        devices=["cuda:0"],
        rollout_command=[sys.executable, str(script)],
        shared_lora_capacity=4,
    )

    async def main() -> None:
        shared = SharedRollouts(settings, env=dict(os.environ))
        assert await shared.join("a", "base-a", device_ids=["h/cuda:0"]) is not None
        full = _run(tmp_path, "c", ["h/cuda:0"])
        full.job.CopyFrom(_job("c", common_pb2.FINETUNE_MODE_FULL))
        holders = holders_of(full, {}, shared)
        assert len(holders) == 1
        (pid,) = {int(p) for p in _pids_of(script)}
        os.kill(pid, signal.SIGKILL)  # no job leaves: the process is simply gone
        assert await asyncio.wait_for(full.until_done(list(holders.values())), 5) is True
        await shared.leave("a", "base-a")
        await shared.close()

    asyncio.run(main())


def _pids_of(script: Path) -> list[str]:
    found = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    return found.stdout.split()


def test_a_stream_stuck_in_its_write_does_not_hold_up_the_wait_or_a_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JobWaiting goes out on the worker's stream; a write that never returns held the
    wait before it began, and with it a stop meant to end the attempt unstarted."""
    monkeypatch.setattr(device_handover, "SAY_TIMEOUT_S", 0.1, raising=False)

    async def main() -> None:
        holder_task = asyncio.create_task(asyncio.sleep(3600))
        new = _run(tmp_path, "new", ["h/cuda:0"])

        async def stuck(**payload: object) -> None:
            await asyncio.Event().wait()

        waiting = asyncio.create_task(run_when_free(new, {"old/1": holder_task}, say=stuck))
        await asyncio.sleep(0.05)
        new.stop("cancelled by the user")
        outcome = await asyncio.wait_for(waiting, 2)
        assert outcome.reason == "stopped: cancelled by the user"
        holder_task.cancel()

    asyncio.run(main())
