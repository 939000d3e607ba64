"""Faults in the middle of a real RL job through the whole mesh: nothing is lost.

The mesh is the real one (its own redis-server, scheduler, envhub and worker as processes; the
worker starts a real trainer and rollout with a tiny model). A service is killed with SIGKILL
while the job runs and started again where it was; the job must end SUCCEEDED with exactly one
attempt (no second lease, no re-run), every step reported once, and the mesh must take new jobs.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis
from fault_report import record_fault
from ledger_helpers import assert_no_double_lease

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.env_server import serve
from opentinker.errors import UnavailableError
from opentinker.game import StepResult
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Enough steps that the fault lands mid-job: a step of this job takes ~40 ms on 2 CPU cores.
STEPS = 30


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # No Redis URL: the mesh runs its own redis-server (AOF on), which the tests kill.
    with LocalMesh(MeshSettings(run_root=tmp_path_factory.mktemp("faults"))) as running:
        yield running


@pytest.fixture()
def client(mesh):
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as c:
        yield c


def letter_job(model: Path, steps: int = STEPS, env_name: str = "letter") -> JobSpec:
    rl = RlConfig(
        env_name=env_name,
        env_options={"num_letters": "1"},
        steps=steps,
        prompts_per_step=4,
        samples_per_prompt=4,
        learning_rate=1e-3,
        sampling=SamplingParams(max_new_tokens=1),
        seed=1,
    )
    return JobSpec(name="fault", model=ModelSpec(base_model=str(model), finetune="full"), rl=rl)


def wait_for_step(client: opentinker.Client, job_id: str, step: int) -> None:
    for event in client.watch(job_id, timeout=300):
        assert not event.terminal, f"the job ended before step {step}: {event.reason}"
        if event.kind == "step" and event.step >= step:
            return


def wait_until_done(client: opentinker.Client, job_id: str, timeout_s: float = 300):
    """The finished job; rides out the moments the scheduler (or its Redis) is away."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            job = client.get_job(job_id)
        except UnavailableError:
            job = None
        if job is not None and job.done:
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish within {timeout_s:.0f} s")


def assert_one_clean_attempt(mesh: LocalMesh, client: opentinker.Client, job_id: str) -> None:
    job = wait_until_done(client, job_id)
    assert job.state == "SUCCEEDED", job.reason
    assert job.attempt == 1, f"the job ran {job.attempt} attempts"
    events = list(client.watch(job_id, timeout=60))
    states = [e.state for e in events if e.kind == "state"]
    assert states == ["QUEUED", "ALLOCATING", "RUNNING", "SUCCEEDED"], states
    steps = [e.step for e in events if e.kind == "step"]
    # Reports were retried, never dropped: every step once, in order.
    assert steps == list(range(1, STEPS + 1)), steps
    # One lease, never two at once (from the ledger's own history of acquires and releases).
    assert_no_double_lease(mesh.redis_url, job_id, attempts=1)
    # No lease left behind: the one lease of the one attempt was released at its exit.
    ledger = redis.Redis.from_url(mesh.redis_url)
    try:
        deadline = time.monotonic() + 10
        while ledger.scard("ot:ledger:leases") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ledger.scard("ot:ledger:leases") == 0
    finally:
        ledger.close()


def assert_takes_new_jobs(client: opentinker.Client, model: Path) -> None:
    job = client.fit(letter_job(model, steps=1), timeout=300)
    assert job.state == "SUCCEEDED" and job.attempt == 1


def test_scheduler_sigkill_mid_job(mesh, client, letter_model_dir: Path) -> None:
    job = client.submit(letter_job(letter_model_dir))
    wait_for_step(client, job.job_id, 2)
    mesh.kill("scheduler")
    time.sleep(2.0)  # the worker and the trainer find nobody there, and keep going
    mesh.restart("scheduler")
    assert_one_clean_attempt(mesh, client, job.job_id)
    assert_takes_new_jobs(client, letter_model_dir)
    record_fault("scheduler", "1 attempt, every step once, no double lease, new job ok")


def test_redis_sigkill_mid_job(mesh, client, letter_model_dir: Path) -> None:
    job = client.submit(letter_job(letter_model_dir))
    wait_for_step(client, job.job_id, 2)
    mesh.kill("redis")
    with pytest.raises(UnavailableError) as info:  # a clear answer while Redis is away
        client.get_job(job.job_id)
    assert "cannot reach its Redis" in str(info.value)
    time.sleep(2.0)
    mesh.restart("redis")  # same port, same data directory: the append-only file has it all
    assert_one_clean_attempt(mesh, client, job.job_id)
    assert_takes_new_jobs(client, letter_model_dir)
    record_fault("redis-server", "1 attempt, every step once, no double lease, new job ok")


class HeldLetters(LetterGame):
    """The letter game, served by the test: once the hold is armed, steps wait at it."""

    name = "held-letter"
    armed = threading.Event()
    held = threading.Event()  # a step waits at the hold
    released = threading.Event()

    def step(self, action: str) -> StepResult:
        if self.armed.is_set():
            self.held.set()
            self.released.wait(timeout=120)
        return super().step(action)


def test_envhub_sigkill_mid_batch(mesh, client, letter_model_dir: Path) -> None:
    # An env server outside EnvHub (registered with the user's key) whose steps the test can
    # hold: EnvHub is killed while a batch's episodes wait in it, so their stream breaks.
    env = serve(HeldLetters, envhub_address=mesh.envhub_address, api_key=mesh.api_key, block=False)
    try:
        job = client.submit(letter_job(letter_model_dir, env_name=HeldLetters.name))
        wait_for_step(client, job.job_id, 2)
        HeldLetters.armed.set()
        assert HeldLetters.held.wait(timeout=60), "no batch reached the env after step 2"
        mesh.kill("envhub")  # its registry and every route of the batch's episodes die with it
        time.sleep(2.0)  # the rollout finds nobody there and waits (envhub_reconnect_s)
        mesh.restart("envhub")  # same port; the env server registers again on its own
        HeldLetters.armed.clear()
        HeldLetters.released.set()  # the held steps answer a dead stream: nobody listens
        assert_one_clean_attempt(mesh, client, job.job_id)
        # The rollout reconnected mid-batch; no episode was counted as an env failure.
        rollout_log = mesh.run_root / "jobs" / job.job_id / "attempt-1" / "rollout.log"
        lines = rollout_log.read_text().splitlines()
        assert any("envhub_reconnected" in line and "stream_lost=True" in line for line in lines)
        batches = [line for line in lines if "batch_collected" in line]
        assert len(batches) == STEPS
        assert sum("envhub_reconnects=1" in line for line in batches) == 1
        assert all("env_errors=0 env_retries=0" in line for line in batches), batches
    finally:
        env.stop(0)
    assert_takes_new_jobs(client, letter_model_dir)
    record_fault("EnvHub", "reconnected mid-batch; 1 attempt, every step once, no double lease")
