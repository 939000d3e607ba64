"""A verifiers 0.4 env trains through the real mesh: the RL job's agent is
``verifiers04_program`` (tests/rollout/vf04_envs/opentinker_letters04, its taskset, its two-turn
harness, its rubric), run by the rollout per episode with the 0.4 environment's Python.

One step of one GRPO group of two keeps it short (each episode starts a Python that imports
verifiers 0.4, seconds of CPU); tests/rollout/test_verifiers04.py checks the tokens and masks of
such episodes one by one. The rubric gives 0.3 + 0.4 * hit, never the 0 or 1 of the job's env.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_verifiers04 import letters_program, needs_vf04

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow, needs_vf04]

RUBRIC_MEANS = (0.3, 0.5, 0.7)  # two episodes, each 0.3 (miss) or 0.7 (hit)


def test_a_verifiers04_env_trains_through_the_mesh(tmp_path: Path, letter_model_dir: Path) -> None:
    spec = JobSpec(
        name="verifiers04-rl",
        model=ModelSpec(base_model=str(letter_model_dir), finetune="lora"),
        rl=RlConfig(
            # The job's env only opens each episode (Reset); the 0.4 env picks its own task by
            # the episode's seed and its rubric gives the reward.
            env_name="letter",
            env_options={"num_letters": "4"},
            steps=1,
            prompts_per_step=1,
            samples_per_prompt=2,
            learning_rate=1e-3,
            sampling=SamplingParams(max_new_tokens=3),
            max_episode_tokens=256,
            agent=letters_program(timeout_s=240),
        ),
    )
    events = []
    settings = MeshSettings(run_root=tmp_path / "mesh", agent_programs=True)
    with (
        LocalMesh(settings) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client,
    ):
        job = client.fit(spec, on_event=events.append, timeout=400)
    assert job.state == "SUCCEEDED", job.reason
    [metrics] = [e.metrics for e in events if e.kind == "step"]
    assert metrics["episodes"] == 2.0 and metrics["env_errors"] == 0.0
    assert metrics["env_turns_mean"] == 2.0 and metrics["agent_rewrites"] == 0.0
    assert metrics["tokens_generated"] > 0 and metrics["completion_len_mean"] > 0
    assert min(abs(metrics["reward_mean"] - m) for m in RUBRIC_MEANS) < 1e-6, metrics
