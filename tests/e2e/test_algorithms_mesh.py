"""The algorithm's knobs through the real mesh: a PPO job with a critic, a KL term, several
optimizer steps per batch, micro-batches and an LR warmup crosses the wire, runs in the
worker's trainer process and leaves a checkpoint with its value head."""

from __future__ import annotations

from pathlib import Path

import pytest

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with LocalMesh(MeshSettings(run_root=tmp_path_factory.mktemp("mesh"))) as running:
        yield running


def test_a_ppo_job_with_kl_and_epochs_runs_through_the_mesh(mesh, letter_model_dir: Path) -> None:
    spec = JobSpec(
        name="ppo-kl",
        model=ModelSpec(base_model=str(letter_model_dir), finetune="lora"),
        rl=RlConfig(
            env_name="letter",
            env_options={"num_letters": "4"},
            steps=3,
            prompts_per_step=2,
            samples_per_prompt=4,
            learning_rate=1e-3,
            sampling=SamplingParams(max_new_tokens=2),
            max_episode_tokens=64,
            loss="ppo",
            critic_learning_rate=1e-3,
            ppo_epochs=2,
            minibatch_size=4,
            micro_batch_tokens=64,
            kl_coef=0.1,
            warmup_steps=2,
            checkpoint_every=1,
        ),
    )
    events = []
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
        job = client.fit(spec, on_event=events.append, timeout=240)
    assert job.state == "SUCCEEDED", job.reason
    steps = {e.step: e.metrics for e in events if e.kind == "step"}
    assert sorted(steps) == [1, 2, 3]
    for metrics in steps.values():
        # 2 epochs x (8 episodes / minibatch 4) = 4 optimizer steps per batch
        assert metrics["optimizer_steps"] == 4.0
        assert metrics["value_loss"] > 0.0 and metrics["kl"] >= 0.0
    # warmup over 2 steps: lr(step 1) = 1e-3 * 1/2 (hand: factor (0 + 1) / 2), then the full 1e-3
    assert steps[1]["lr"] == pytest.approx(5e-4)
    assert steps[3]["lr"] == pytest.approx(1e-3)
    assert steps[1]["kl"] == pytest.approx(0.0, abs=1e-6)  # starts at the reference
    assert (Path(job.checkpoint_uri) / "critic.pt").is_file()
