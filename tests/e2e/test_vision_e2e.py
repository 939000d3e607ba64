"""End to end with images: the real mesh trains the tiny Qwen2-VL model on the built-in
``geometry_tools`` env (a drawn figure per episode, a calculator tool) for a few steps."""

from __future__ import annotations

from pathlib import Path

import pytest

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_vl_model import ensure_tiny_vl_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_vl_model_trains_on_the_geometry_env_through_the_mesh(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = ensure_tiny_vl_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")
    spec = JobSpec(
        name="vision-e2e",
        model=ModelSpec(base_model=str(model_dir), finetune="full"),
        rl=RlConfig(
            env_name="geometry_tools",
            env_options={"max_turns": "2", "number_reward": "0.5"},
            steps=2,
            prompts_per_step=2,
            samples_per_prompt=4,
            learning_rate=1e-3,
            sampling=SamplingParams(max_new_tokens=8),
            seed=1,
            max_staleness=0,  # every batch sampled by the weights it trains: logprobs comparable
        ),
    )
    settings = MeshSettings(run_root=tmp_path_factory.mktemp("mesh"))
    with (
        LocalMesh(settings) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client,
    ):
        events: list = []
        job = client.fit(spec, timeout=240, on_event=events.append)
    assert job.state == "SUCCEEDED", job.reason
    assert job.final_metrics["policy_version"] == 2  # two updates, each synced to the rollout
    # The trainer's logprobs (token ids + the image bytes run through the processor again)
    # are the rollout's: the figure reached both sides the same (fp32 on CPU).
    steps = [e.metrics for e in events if e.kind == "step"]
    assert [m["env_errors"] for m in steps] == [0.0, 0.0]
    # Rewards differed within groups, so both steps really updated the weights ...
    assert all(m["optimizer_steps"] >= 1 and m["tokens_trained"] > 0 for m in steps), steps
    # ... from logprobs the trainer recomputed (token ids + the image bytes through the
    # processor again) equal to the rollout's: the figures reached both sides alike (fp32).
    assert all(m["logprob_gap"] < 1e-4 for m in steps), [m["logprob_gap"] for m in steps]
    assert Path(job.checkpoint_uri, "model.safetensors").exists()
