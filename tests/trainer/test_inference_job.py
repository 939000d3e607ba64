"""Inference as a job on the pool, and validation during RL, through the real mesh (Redis,
scheduler, envhub, worker, and the trainer + rollout processes the worker starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import opentinker
from opentinker import InferenceConfig, JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.inference_rows import summarize
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.rollout.agent.seeds import eval_episode_seed

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with LocalMesh(MeshSettings(run_root=tmp_path_factory.mktemp("mesh"))) as running:
        yield running


@pytest.fixture()
def client(mesh):
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as c:
        yield c


def test_opentinker_infer_runs_a_job_and_writes_its_rows(
    client, mesh, letter_model_dir: Path, tmp_path: Path
) -> None:
    output = tmp_path / "rows.jsonl"
    command = [
        sys.executable, "-m", "opentinker", "--scheduler", mesh.scheduler_address, "infer",
        "--model", str(letter_model_dir), "--env", "letter", "--option", "num_letters=4",
        "--episodes", "6", "--concurrency", "4", "--max-new-tokens", "2", "--seed", "5",
        "--output", str(output),
    ]  # fmt: skip
    started = time.monotonic()
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OPENTINKER_API_KEY": mesh.api_key},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(6))
    for row in rows:
        assert row["finish_reason"] == "ENV_DONE" and row["turns"] == 1
        assert row["info"]["target"] in "ABCD" and row["completion"]
        assert row["reward"] in (0.0, 1.0) and not row["truncated"]
        assert row["env_seed"] == eval_episode_seed(5, row["index"])  # as `infer --local` plays
    summary = summarize(rows, output)
    assert summary.describe("letter") in out.stdout.replace("\n", "")

    # The job's result carries the same summary; a late watcher replays every row.
    job = next(j for j in client.list_jobs() if j.name == "infer-letter")
    assert job.state == "SUCCEEDED", job.reason
    assert job.final_metrics == pytest.approx(summary.metrics())
    assert list(client.results(job.job_id)) == rows
    # The tokens its episodes generated count in the tenant's usage, on the job.
    (tenant,) = client.usage(max_jobs=50)
    (usage,) = [j.usage for j in tenant.jobs if j.job_id == job.job_id]
    assert usage.tokens_generated == sum(r["completion_tokens"] for r in rows) > 0
    assert time.monotonic() - started < 90


def test_an_env_that_fails_every_episode_fails_the_job_naming_it(
    client, letter_model_dir: Path
) -> None:
    spec = JobSpec(
        kind="inference",
        model=ModelSpec(base_model=str(letter_model_dir), finetune="full"),
        inference=InferenceConfig(
            env_name="letter", env_options={"no_such_option": "1"}, episodes=2
        ),
    )
    rows = []
    with pytest.raises(opentinker.JobFailedError) as info:
        rows.extend(client.infer(spec, timeout=120))
    assert len(rows) == 2 and all(r["finish_reason"] == "ENV_ERROR" for r in rows)
    assert "every one of 2 episodes of env 'letter' failed" in info.value.reason


def test_rl_job_with_val_every_reports_validation_metrics(client, letter_model_dir: Path) -> None:
    spec = JobSpec(
        name="val",
        model=ModelSpec(base_model=str(letter_model_dir), finetune="full"),
        rl=RlConfig(
            env_name="letter",
            env_options={"num_letters": "4"},
            steps=3,
            prompts_per_step=2,
            samples_per_prompt=2,
            sampling=SamplingParams(max_new_tokens=1),
            val_every=2,
            val_episodes=5,
        ),
    )
    events = []
    job = client.fit(spec, on_event=events.append, timeout=180)
    steps = {e.step: e.metrics for e in events if e.kind == "step"}
    assert sorted(steps) == [1, 2, 3]
    assert "val/reward_mean" not in steps[1]  # every 2 steps, and after the last one
    for step in (2, 3):
        val = steps[step]
        assert val["val/episodes"] == 5 and val["val/env_errors"] == 0
        assert 0.0 <= val["val/accuracy"] <= 1.0 and val["val/turns_mean"] == 1.0
        # Training episodes are the step's own: 2 prompts x 2 samples, no validation ones.
        assert val["env_episodes"] == 4
    assert job.final_metrics["val/reward_mean"] == steps[3]["val/reward_mean"]


def test_a_cancelled_inference_job_stops_early(client, letter_model_dir: Path) -> None:
    spec = JobSpec(
        kind="inference",
        model=ModelSpec(base_model=str(letter_model_dir), finetune="full"),
        inference=InferenceConfig(
            env_name="letter", episodes=2000, concurrency=2, sampling={"max_new_tokens": 1}
        ),
    )
    jobs, rows = [], []
    with pytest.raises(opentinker.JobFailedError) as info:
        for row in client.infer(spec, on_submit=jobs.append, timeout=120):
            rows.append(row)
            if len(rows) == 1:
                client.cancel(jobs[0].job_id, reason="enough")
    assert info.value.code == "CANCELLED" and "enough" in info.value.reason
    assert 1 <= len(rows) < 2000


def test_val_env_options_reach_only_the_validation_episodes(client, letter_model_dir) -> None:
    spec = JobSpec(
        name="val-options",
        model=ModelSpec(base_model=str(letter_model_dir), finetune="full"),
        rl=RlConfig(
            env_name="letter",
            steps=1,
            prompts_per_step=2,
            samples_per_prompt=2,
            sampling=SamplingParams(max_new_tokens=1),
            val_every=1,
            val_episodes=3,
            val_env_options={"no_such_option": "1"},  # the letter env refuses it at reset
        ),
    )
    events = []
    client.fit(spec, on_event=events.append, timeout=120)
    (step,) = [e.metrics for e in events if e.kind == "step"]
    assert step["env_episodes"] == 4 and step["env_reward_mean"] >= 0.0  # training played
    assert step["val/env_errors"] == 3.0 and step["val/episodes"] == 3.0
