"""End to end: the real mesh as separate processes (Redis, scheduler, envhub, worker, and the
trainer + rollout the worker starts), a real tiny model that really learns."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model(letter_model_dir: Path) -> Path:
    """The tiny model after a nudge to answer with some letter A..D (see conftest)."""
    return letter_model_dir


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # No Redis URL: the launcher starts its own redis-server, as `opentinker up` does.
    settings = MeshSettings(run_root=tmp_path_factory.mktemp("mesh"))
    with LocalMesh(settings) as running:
        yield running


@pytest.fixture()
def client(mesh):
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as c:
        yield c


def letter_job(model: Path, **rl) -> JobSpec:
    options = {
        "env_name": "letter",
        "env_options": {"num_letters": "1"},
        "steps": 30,
        "prompts_per_step": 8,
        "samples_per_prompt": 8,
        "learning_rate": 1e-3,
        "sampling": SamplingParams(max_new_tokens=1),
        "stop_at_reward": 0.95,
        "seed": 1,
    }
    options.update(rl)
    return JobSpec(
        name="e2e", model=ModelSpec(base_model=str(model), finetune="full"), rl=RlConfig(**options)
    )


def test_rl_job_learns_through_every_service(client, mesh, tiny_model) -> None:
    events = []
    job = client.fit(letter_job(tiny_model), on_event=events.append, timeout=540)
    assert job.state == "SUCCEEDED", job.reason
    states = [e.state for e in events if e.kind == "state"]
    assert states[0] == "QUEUED" and "RUNNING" in states and states[-1] == "SUCCEEDED"

    steps = [e for e in events if e.kind == "step"]
    assert len(steps) >= 2
    versions = [e.policy_version for e in steps]
    assert versions == sorted(versions) and versions[-1] > versions[0], versions
    rewards = [e.metrics["reward_mean"] for e in steps]
    assert max(rewards[-3:]) > rewards[0] + 0.2, f"reward did not rise: {rewards}"
    for key in (
        "loss",
        "entropy",
        "tokens_per_s",
        "time_generate_s",
        "time_env_s",
        "time_train_s",
        "time_weight_sync_s",
        "env_episodes",
        "env_reward_mean",
        "env_turns_mean",
        "env_win_rate",
    ):
        assert key in steps[-1].metrics, key
    assert job.final_metrics["reward_mean_last10"] >= rewards[0] + 0.2
    last = steps[-1].metrics  # env statistics of the step: the letter env reports win/loss
    assert last["env_episodes"] == 64 and last["env_turns_mean"] == 1.0
    assert last["env_win_rate"] == pytest.approx(last["env_reward_mean"])

    # The checkpoint is a real HF checkpoint: it loads through from_pretrained.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(job.checkpoint_uri)
    tokenizer = AutoTokenizer.from_pretrained(job.checkpoint_uri)
    assert model.config.vocab_size == len(tokenizer)

    # A late `opentinker tail` replays the whole run from the event stream; the key comes from
    # the environment, as a user's shell would have it.
    tail = [sys.executable, "-m", "opentinker", "--scheduler", mesh.scheduler_address, "tail"]
    as_user = {**os.environ, "OPENTINKER_API_KEY": mesh.api_key}
    out = subprocess.run(
        [*tail, job.job_id], capture_output=True, text=True, timeout=60, env=as_user
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "QUEUED" in out.stdout and "SUCCEEDED" in out.stdout
    assert out.stdout.count("step") >= len(steps)


def test_lora_job_saves_an_adapter_that_loads(client, tiny_model) -> None:
    spec = letter_job(tiny_model, steps=2, stop_at_reward=None)
    spec = spec.model_copy(update={"model": ModelSpec(base_model=str(tiny_model), finetune="lora")})
    job = client.fit(spec, timeout=300)
    assert job.state == "SUCCEEDED", job.reason
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    model = PeftModel.from_pretrained(base, job.checkpoint_uri)
    assert any("lora_" in name for name, _ in model.named_parameters())
    assert job.final_metrics["policy_version"] == 2


def test_unknown_env_fails_the_job_fast_naming_it(client, tiny_model) -> None:
    started = time.monotonic()
    with pytest.raises(opentinker.JobFailedError) as info:
        client.fit(letter_job(tiny_model, env_name="no-such-env"), timeout=120)
    assert "no-such-env" in info.value.reason
    assert time.monotonic() - started < 60


def test_env_server_that_is_down_fails_the_job_naming_it(client, mesh, tiny_model) -> None:
    from opentinker.services.envhub.games.letter_env import LetterGame

    handle = opentinker.serve(
        LetterGame,
        name="flaky-letters",
        envhub_address=mesh.envhub_address,
        api_key=mesh.api_key,
        block=False,
    )
    # The server dies without deregistering (its registration thread keeps renewing, as a hung
    # or half-dead process would): EnvHub still lists it, but nothing answers at its address.
    handle.server.stop(0).wait()
    try:
        started = time.monotonic()
        with pytest.raises(opentinker.JobFailedError) as info:
            client.fit(letter_job(tiny_model, env_name="flaky-letters"), timeout=120)
        assert "flaky-letters" in info.value.reason
        assert time.monotonic() - started < 60
    finally:
        handle.stop()


def test_bad_requests_get_clear_status_codes(client) -> None:
    with pytest.raises(opentinker.NotFoundError) as info:
        client.get_job("job-does-not-exist")
    assert "job-does-not-exist" in str(info.value)


def test_no_credential_reaches_a_log_file(client, mesh, tiny_model) -> None:
    """After jobs ran through every service: no API key, job token or worker token secret in
    any log the mesh wrote (services, trainers, rollouts). Launch files hold the job token,
    readable by their owner only."""
    import re

    client.fit(letter_job(tiny_model, steps=2, stop_at_reward=None), timeout=300)
    credential = re.compile(r"ot[kjw]_[0-9a-f]{12}_[A-Za-z0-9_-]{20,}")
    logs = list(mesh.run_root.rglob("*.log"))
    assert len(logs) >= 5  # scheduler, envhub, worker, redis, and each job's trainer/rollout
    leaks = [p for p in logs if credential.search(p.read_text(errors="replace"))]
    assert leaks == [], leaks
    secrets_dir = mesh.run_root / "secrets"
    for path in [*mesh.run_root.rglob("launch.json"), *secrets_dir.iterdir()]:
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
