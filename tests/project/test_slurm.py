"""deploy/slurm/opentinker-workers.sbatch starts one worker agent per node of an allocation.

Slurm itself cannot run here, so ``srun`` is a stand-in on PATH that runs the step's command
once, as node ``node-a`` would (SLURMD_NODENAME set): the batch script, the worker agent and
the scheduler it registers with are the real ones. A SIGTERM to the step (what Slurm sends
120 s before the time limit, `--signal=TERM@120`) makes the worker close cleanly and the batch
script end with it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from identity_helpers import worker_token
from scheduler_helpers import scheduler_mesh

from opentinker.scheduler.v1 import scheduler_pb2

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "opentinker-workers.sbatch"
pytestmark = pytest.mark.integration

FAKE_SRUN = """#!/bin/bash
# A one-node srun: drop srun's own options, run the step as node-a would.
while [[ "$1" == --* ]]; do shift; done
export SLURMD_NODENAME=node-a SLURM_PROCID=0
echo $$ > "$STEP_PID_FILE"  # the step's task (exec keeps the pid): Slurm signals it
exec "$@"
"""


def batch_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_JOB_ID="77",
        OPENTINKER_BIN=str(Path(sys.executable).parent / "opentinker"),
        OPENTINKER_ENVHUB_ADDRESS="127.0.0.1:1",
        OPENTINKER_WORKER_TOKEN_DIR=str(tmp_path / "tokens"),
        OPENTINKER_CHECKPOINT_ROOT=str(tmp_path / "checkpoints"),
        OPENTINKER_RUN_ROOT=str(tmp_path / "runs"),
        STEP_PID_FILE=str(tmp_path / "step.pid"),
    )
    env.update(overrides)
    return env


def test_the_batch_script_refuses_to_start_without_the_scheduler_address(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(SBATCH)], env=batch_env(tmp_path), capture_output=True, text=True, timeout=30
    )
    assert done.returncode != 0
    assert "OPENTINKER_SCHEDULER_ADDRESS" in done.stderr


def test_each_node_registers_under_its_name_and_closes_cleanly_on_sigterm(
    redis_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            identity = mesh.running.stores.identity
            tokens = tmp_path / "tokens"
            tokens.mkdir()
            token = await worker_token(identity, worker_id="node-a")
            (tokens / "node-a.token").write_text(token + "\n")
            (tokens / "node-a.token").chmod(0o600)
            env = batch_env(tmp_path, OPENTINKER_SCHEDULER_ADDRESS=mesh.running.address)
            batch = subprocess.Popen(["bash", str(SBATCH)], env=env, start_new_session=True)
            try:
                await until_workers(mesh, ["node-a"], timeout_s=60)
                os.kill(int((tmp_path / "step.pid").read_text()), signal.SIGTERM)
                await until_workers(mesh, [], timeout_s=30)
                assert await asyncio.to_thread(batch.wait, 30) == 0
            finally:
                if batch.poll() is None:
                    os.killpg(batch.pid, signal.SIGKILL)

    asyncio.run(main())


async def until_workers(mesh, wanted: list[str], *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        listed = await mesh.stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
        ids = sorted(w.worker_id for w in listed.workers)
        if ids == wanted:
            return
        assert time.monotonic() < deadline, f"workers {ids}, waited for {wanted}"
        await asyncio.sleep(0.2)
