"""Two LoRA jobs of one base model through the real mesh (Redis, scheduler, EnvHub, a worker
with two CPU slots and shared LoRA engines on, real trainer processes): both run against the
one shared rollout the worker started, both succeed, and the shared process ends with them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import opentinker
from opentinker import JobSpec, LoraConfig, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def lora_job(model: Path, target: str, seed: int) -> JobSpec:
    rl = RlConfig(
        env_name="letter",
        env_options={"num_letters": "4", "target": target},
        steps=4,
        prompts_per_step=2,
        samples_per_prompt=4,
        learning_rate=2e-2,
        sampling=SamplingParams(max_new_tokens=2),
        seed=seed,
    )
    model_spec = ModelSpec(base_model=str(model), finetune="lora", lora=LoraConfig(rank=4))
    return JobSpec(name=f"shared-{target}", model=model_spec, rl=rl)


def test_two_lora_jobs_share_the_workers_rollout_through_the_mesh(
    tmp_path: Path, letter_model_dir: Path
) -> None:
    settings = MeshSettings(
        run_root=tmp_path / "mesh", cpu_slots=2, warm_spares=0, shared_lora_capacity=2
    )
    with (
        LocalMesh(settings) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client,
    ):
        ids = [
            client.submit(lora_job(letter_model_dir, target, seed)).job_id
            for target, seed in (("A", 1), ("B", 2))
        ]
        for job_id in ids:
            for _ in client.watch(job_id, timeout=300):
                pass
        jobs = [client.get_job(job_id) for job_id in ids]
        assert [j.state for j in jobs] == ["SUCCEEDED", "SUCCEEDED"], [j.reason for j in jobs]
        worker_log = (mesh.log_dir / "worker.log").read_text()
        addresses = set()
        for job_id in ids:
            attempt = mesh.run_root / "jobs" / job_id / "attempt-1"
            assert not (attempt / "rollout.pid").exists()  # no private rollout
            addresses.add((attempt / "rollout.addr").read_text().strip())
            joined = [ln for ln in worker_log.splitlines() if "shared_rollout_joined" in ln]
            assert any(job_id in ln for ln in joined), joined
        assert len(addresses) == 1  # one shared rollout served both
        shared_logs = list((mesh.run_root / "jobs" / "shared-rollouts").glob("*/rollout.log"))
        assert len(shared_logs) == 1
        deadline = time.monotonic() + 30
        while "shared_rollout_stopped" not in worker_log and time.monotonic() < deadline:
            time.sleep(0.2)
            worker_log = (mesh.log_dir / "worker.log").read_text()
        assert "shared_rollout_stopped" in worker_log  # the last job out stopped it
        assert not mesh.dead_processes()
