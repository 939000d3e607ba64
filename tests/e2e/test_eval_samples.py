"""pass@k with several samples of each problem: ``InferenceConfig.samples_per_episode`` and
``opentinker eval --samples N``. The statistics by hand (unit), then an eval job with samples
through the real mesh (Redis, scheduler, envhub, worker, trainer and rollout processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from opentinker import Client, InferenceConfig
from opentinker.eval_stats import evaluate, paired_difference
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.rollout.agent.seeds import eval_episode_seed


def _row(index: int, reward: float) -> dict:
    return {"index": index, "env_seed": 100 + index, "reward": reward}


@pytest.mark.unit
def test_samples_of_a_problem_make_pass_at_k_and_an_interval_over_problems() -> None:
    # problem 0: 2 of 3 right; problem 1: 0 of 3; problem 2: 3 of 3
    rows = [_row(0, r) for r in (1, 0, 1)] + [_row(1, 0)] * 3 + [_row(2, 1)] * 3
    result = evaluate(rows, ks=(1, 2, 3))
    assert (result.episodes, result.problems) == (9, 3)
    # pass@1 = mean(2/3, 0, 1) = 5/9; pass@2 = mean(1 - C(1,2)/C(3,2) = 1, 0, 1) = 2/3
    assert result.pass_at[1] == pytest.approx(5 / 9)
    assert result.pass_at[2] == pytest.approx(2 / 3) and result.pass_at[3] == pytest.approx(2 / 3)
    # The accuracy's interval is over problems, not draws: rates 2/3, 1/3, 2/3, 1/3 give
    # sd = sqrt(4 * (1/6)^2 / 3) = 0.19245 and 1.96 * 0.19245 / sqrt(4) = 0.18860
    rates = [(1, 1, 0), (1, 0, 0), (0, 1, 1), (0, 0, 1)]
    spread = evaluate([_row(i, r) for i, tries in enumerate(rates) for r in tries])
    assert spread.accuracy.value == pytest.approx(0.5)
    assert spread.accuracy.high - 0.5 == pytest.approx(0.18860, abs=1e-4)
    assert spread.accuracy.low == pytest.approx(0.5 - 0.18860, abs=1e-4)
    assert "(3 problems, 3 samples each)" in result.describe()
    # Paired: sample j of a problem against sample j of the same problem
    after = [_row(0, 1)] * 3 + [_row(1, 1)] + [_row(1, 0)] * 2 + [_row(2, 1)] * 3
    assert paired_difference(rows, after).value == pytest.approx(2 / 9)  # +1 on 0 and on 1


@pytest.mark.unit
def test_samples_need_sampling_and_a_bounded_row_count() -> None:
    assert InferenceConfig(env_name="x", episodes=10, samples_per_episode=8).samples_per_episode
    with pytest.raises(ValidationError, match="greedy decoding plays every sample"):
        InferenceConfig(env_name="x", samples_per_episode=2, greedy=True)
    with pytest.raises(ValidationError, match="episodes x samples_per_episode is 20000"):
        InferenceConfig(env_name="x", episodes=5000, samples_per_episode=4)


@pytest.mark.integration
@pytest.mark.slow
def test_opentinker_eval_samples_each_problem_through_the_mesh(
    letter_model_dir: Path, tmp_path: Path
) -> None:
    with LocalMesh(MeshSettings(run_root=tmp_path / "mesh", warm_spares=0)) as mesh:
        command = [
            sys.executable, "-m", "opentinker", "--scheduler", mesh.scheduler_address, "eval",
            "--model", str(letter_model_dir), "--env", "countdown", "--episodes", "3",
            "--samples", "4", "--temperature", "1.0", "--max-new-tokens", "2", "--seed", "5",
            "--output-dir", str(tmp_path / "eval"),
        ]  # fmt: skip
        out = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "OPENTINKER_API_KEY": mesh.api_key, "COLUMNS": "200"},
        )
        with Client(mesh.scheduler_address, api_key=mesh.api_key) as client:
            (job,) = list(client.list_jobs())
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [
        json.loads(line) for line in (tmp_path / "eval" / "model.jsonl").read_text().splitlines()
    ]
    assert sorted(r["index"] for r in rows) == [0] * 4 + [1] * 4 + [2] * 4
    assert len({r["episode_id"] for r in rows}) == 12
    for row in rows:  # the samples of a problem play its one env seed
        assert row["env_seed"] == eval_episode_seed(5, row["index"])
    said = " ".join(out.stdout.split())
    assert "pass@1" in said and "pass@4" in said and "(3 problems, 4 samples each)" in said
    # The job's own result carries them too
    assert job.final_metrics["pass@4"] == pytest.approx(evaluate(rows, ks=(4,)).pass_at[4])
    assert job.final_metrics["episodes"] == 12
