"""A job that leases 2 devices trains on 2 trainer ranks, through the real mesh (Redis,
scheduler, EnvHub, a worker with 2 CPU "devices", and the rollout and trainer processes the
worker starts): rank 0 drives, rank 1 follows every collective over gloo. Its first update
equals a 1-rank job's on the same batch; a rank that dies ends the attempt with a reason that
names it, and the next attempt's 2 ranks resume from the last checkpoint."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import opentinker
from opentinker import JobSpec, LoraConfig, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    settings = MeshSettings(run_root=tmp_path_factory.mktemp("ranks"), cpu_slots=2, warm_spares=0)
    with LocalMesh(settings) as running:
        yield running


def spec(model: Path, *, num_devices: int, steps: int, finetune: str = "full") -> JobSpec:
    rl = RlConfig(
        env_name="letter",
        env_options={"num_letters": "4"},
        steps=steps,
        checkpoint_every=1,
        prompts_per_step=2,
        samples_per_prompt=4,
        learning_rate=1e-3,
        sampling=SamplingParams(max_new_tokens=1),
        seed=3,
    )
    model_spec = ModelSpec(base_model=str(model), finetune=finetune, lora=LoraConfig(rank=4))
    return JobSpec(name=f"ranks-{num_devices}", model=model_spec, rl=rl, num_devices=num_devices)


def fit(mesh, job: JobSpec) -> tuple[opentinker.JobInfo, dict[int, dict[str, float]]]:
    events: list = []
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
        done = client.fit(job, on_event=events.append, timeout=240)
    return done, {e.step: e.metrics for e in events if e.kind == "step"}


def test_two_ranks_train_a_two_device_job_as_one_rank_would(mesh, letter_model_dir) -> None:
    one, one_steps = fit(mesh, spec(letter_model_dir, num_devices=1, steps=1))
    two, two_steps = fit(mesh, spec(letter_model_dir, num_devices=2, steps=1))
    assert one.state == "SUCCEEDED", one.reason
    assert two.state == "SUCCEEDED", two.reason
    attempt = mesh.run_root / "jobs" / two.job_id / "attempt-1"
    leader, follower = (attempt / "trainer.log").read_text(), attempt / "trainer-rank1.log"
    assert "rank_leading" in leader and "world_size=2" in leader
    assert "rank_following" in follower.read_text() and "rank_stopped" in follower.read_text()
    assert not (mesh.run_root / "jobs" / one.job_id / "attempt-1" / "trainer-rank1.log").exists()
    # Same seed, same start: the same first batch; the 2-rank update is the 1-rank one.
    first_one, first_two = one_steps[1], two_steps[1]
    assert first_two["reward_mean"] == first_one["reward_mean"]
    assert first_two["tokens_trained"] == first_one["tokens_trained"] > 0
    for figure in ("loss", "grad_norm", "entropy", "ratio_mean"):
        assert first_two[figure] == pytest.approx(first_one[figure], rel=1e-4, abs=1e-6), figure
    assert first_two["probe_max_abs_diff"] <= 1e-3  # the rollout serves the gathered weights
    # The final checkpoints (step 1; HF format, written by rank 0) hold the same weights, and
    # they moved from the base model.
    step_1 = "step-000001/model.safetensors"
    weights_one = load_file(mesh.checkpoint_root / one.job_id / step_1)
    weights_two = load_file(mesh.checkpoint_root / two.job_id / step_1)
    base = load_file(letter_model_dir / "model.safetensors")
    assert set(weights_two) == set(weights_one)
    for name, tensor in weights_one.items():
        assert (weights_two[name] - tensor).abs().max() < 1e-5, name
    moved = max((weights_two[n] - base[n]).abs().max().item() for n in base)
    assert moved > 1e-4
    assert two.final_metrics["steps"] == 1


def test_a_dead_rank_ends_the_attempt_and_the_next_two_ranks_resume(mesh, letter_model_dir) -> None:
    job = spec(letter_model_dir, num_devices=2, steps=3, finetune="lora")
    events: list = []
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
        job_id = client.submit(job).job_id
        killed = False
        for event in client.watch(job_id, timeout=300):
            events.append(event)
            if event.kind == "step" and event.step >= 2 and not killed:
                pid_file = mesh.run_root / "jobs" / job_id / "attempt-1" / "trainer-rank1.pid"
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
                killed = True
        final = client.get_job(job_id)
    assert final.state == "SUCCEEDED", final.reason
    assert final.attempt == 2
    requeued = next(e for e in events if e.kind == "state" and e.state == "QUEUED" and e.seq > 1)
    assert "trainer-rank1 process was killed by signal 9 (SIGKILL)" in requeued.reason
    # Killed once step 2 was reported: step 1's checkpoint was complete (step 2's may have
    # been in the making); the new attempt's ranks load it and go on from the step after.
    (resumed,) = [e.message for e in events if e.kind == "log" and "resumed from" in e.message]
    match = re.match(r"resumed from checkpoint step-\d+ \(step (\d+),", resumed)
    assert match is not None and int(match.group(1)) in (1, 2), resumed
    after = [e.step for e in events if e.kind == "step" and e.seq > requeued.seq]
    assert after == list(range(int(match.group(1)) + 1, 4))
    attempt_2 = mesh.run_root / "jobs" / job_id / "attempt-2"
    assert "rank_stopped" in (attempt_2 / "trainer-rank1.log").read_text()
    adapter = load_file(mesh.checkpoint_root / job_id / "step-000003/adapter_model.safetensors")
    assert any(torch.count_nonzero(t) for n, t in adapter.items() if "lora_B" in n)  # trained
