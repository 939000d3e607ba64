"""An agent program trains through the real mesh: the job names a command (an openai-client
tool-calling loop, tests/support/agent_programs.py) that the rollout starts per episode with its
endpoint's URL and key; the env grades its last answer. The same program then plays an
inference job."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.spec import InferenceConfig
from opentinker.spec_agent import AgentProgram

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AGENT = AgentProgram(
    command=(sys.executable, str(Path(__file__).parents[1] / "support" / "agent_programs.py")),
    timeout_s=120,
)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    settings = MeshSettings(run_root=tmp_path_factory.mktemp("mesh"), agent_programs=True)
    with LocalMesh(settings) as running:
        yield running


def test_an_agent_program_trains_and_serves_through_the_mesh(mesh, letter_model_dir: Path) -> None:
    spec = JobSpec(
        name="agent-rl",
        model=ModelSpec(base_model=str(letter_model_dir), finetune="lora"),
        rl=RlConfig(
            env_name="letter",
            env_options={"num_letters": "4"},
            steps=2,
            prompts_per_step=2,
            samples_per_prompt=2,
            learning_rate=1e-3,
            sampling=SamplingParams(max_new_tokens=3),
            max_episode_tokens=256,
            agent=AGENT,
        ),
    )
    events = []
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
        job = client.fit(spec, on_event=events.append, timeout=300)
        assert job.state == "SUCCEEDED", job.reason
        steps = {e.step: e.metrics for e in events if e.kind == "step"}
        assert sorted(steps) == [1, 2]
        for metrics in steps.values():
            assert metrics["env_errors"] == 0.0 and metrics["episodes"] == 4.0
            # Two model calls per episode (ask; answer after the calculator's result), each
            # recorded as a turn of one segment: nothing the agent sent back was rewritten.
            assert metrics["env_turns_mean"] == 2.0
            assert metrics["agent_rewrites"] == 0.0
            assert metrics["tokens_generated"] > 0 and metrics["completion_len_mean"] > 0
        infer = JobSpec(
            name="agent-infer",
            kind="inference",
            model=ModelSpec(base_model=str(letter_model_dir)),
            inference=InferenceConfig(
                env_name="letter",
                episodes=3,
                sampling=SamplingParams(max_new_tokens=3),
                agent=AGENT,
            ),
        )
        served = client.fit(infer, timeout=300)
        assert served.state == "SUCCEEDED", served.reason
        assert served.final_metrics["episodes"] == 3.0
        assert served.final_metrics["env_errors"] == 0.0
