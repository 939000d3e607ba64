"""Warm spares and several jobs at once, through the real mesh (Redis, scheduler, EnvHub, worker
and the trainer/rollout processes it starts or hands a job to), with the tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.spares import SparePool

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    settings = MeshSettings(run_root=tmp_path_factory.mktemp("warm"), cpu_slots=2, warm_spares=1)
    with LocalMesh(settings) as running:
        yield running


@pytest.fixture()
def client(mesh):
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as c:
        yield c


def full_job(model: Path, *, steps: int = 1, seed: int = 3) -> JobSpec:
    """Full fine-tuning with a large learning rate: a step changes the weights a lot."""
    rl = RlConfig(
        env_name="letter",
        env_options={"num_letters": "4"},
        steps=steps,
        prompts_per_step=2,
        samples_per_prompt=4,
        learning_rate=5e-2,
        sampling=SamplingParams(max_new_tokens=1),
        seed=seed,
    )
    return JobSpec(name="warm", model=ModelSpec(base_model=str(model), finetune="full"), rl=rl)


def run_dir(mesh, job_id: str) -> Path:
    return mesh.run_root / "jobs" / job_id / "attempt-1"


def started_warm(mesh, job_id: str) -> dict[str, bool]:
    """Which of the job's processes a warm spare took over: the spare writes ``warm_start`` as
    the first line of the job's log, a cold process never does."""
    return {
        name: "event='warm_start'" in (run_dir(mesh, job_id) / f"{name}.log").read_text()
        for name in ("rollout", "trainer")
    }


def first_step(client, spec: JobSpec) -> tuple[str, dict[str, float]]:
    events = []
    job = client.fit(spec, on_event=events.append, timeout=300)
    steps = [e for e in events if e.kind == "step"]
    return job.job_id, steps[0].metrics


def wait_for_spares(mesh, count: int, timeout_s: float = 120.0) -> None:
    """Until ``count`` spare logs say ``spare_ready`` (imports and model load done)."""
    deadline = time.monotonic() + timeout_s
    spares = mesh.run_root / "jobs" / "spares"
    while time.monotonic() < deadline:
        ready = [p for p in spares.glob("*.log") if "spare_ready" in p.read_text()]
        if len(ready) >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"fewer than {count} spares became ready in {timeout_s:.0f} s")


def test_a_second_job_starts_warm_from_the_base_model_not_the_last_jobs_weights(
    mesh, client, letter_model_dir
) -> None:
    spec = full_job(letter_model_dir)
    cold_id, cold = first_step(client, spec)
    # The base model was new to the worker: its rollout started cold (its trainer may already
    # get a spare, started the moment the rollout asked for this model).
    assert not started_warm(mesh, cold_id)["rollout"]

    wait_for_spares(mesh, 2)  # made for this base model when the first job asked for it
    warm_id, warm = first_step(client, spec)
    assert started_warm(mesh, warm_id) == {"rollout": True, "trainer": True}
    worker_log = (mesh.log_dir / "worker.log").read_text().splitlines()
    handed = [ln for ln in worker_log if "event='warm_start'" in ln and warm_id in ln]
    assert len(handed) == 2, handed  # the worker handed the rollout and the trainer over

    # The first job trained every parameter with a large step; had any of it reached the
    # second job, its first step (sampled from, and trained on, the weights it starts from)
    # would differ. Same spec and seed, fresh base weights: the same numbers.
    for key in ("reward_mean", "entropy", "loss", "grad_norm", "probe_max_abs_diff"):
        assert warm[key] == pytest.approx(cold[key], rel=1e-5, abs=1e-7), key
    assert cold["grad_norm"] > 0  # the first job did change its weights

    # A different seed through the next spare: a different job, not a replay of the last one.
    wait_for_spares(mesh, 4)
    other_id, other = first_step(client, full_job(letter_model_dir, seed=11))
    assert started_warm(mesh, other_id) == {"rollout": True, "trainer": True}
    # (Entropy alone does not tell: the nudged model answers A..D evenly whatever the letter
    # asked, so its entropy differs between prompts by ~1e-6 only.)
    keys = ("reward_mean", "loss", "grad_norm", "entropy")
    assert any(other[k] != pytest.approx(cold[k], rel=1e-4, abs=1e-6) for k in keys), {
        k: (cold[k], other[k]) for k in keys
    }


def test_two_jobs_run_at_once_on_a_worker_with_two_slots(mesh, client, letter_model_dir) -> None:
    # Long jobs (each would take minutes), so that neither can end before the other starts;
    # both are cancelled once seen running together.
    specs = [full_job(letter_model_dir, steps=500, seed=s) for s in (21, 22)]
    ids = [client.submit(spec).job_id for spec in specs]
    try:
        deadline = time.monotonic() + 180
        states = [client.get_job(job_id).state for job_id in ids]
        while states != ["RUNNING", "RUNNING"] and time.monotonic() < deadline:
            assert not any(s in ("SUCCEEDED", "FAILED", "CANCELLED") for s in states), states
            time.sleep(0.2)
            states = [client.get_job(job_id).state for job_id in ids]
        assert states == ["RUNNING", "RUNNING"], f"never both RUNNING; last states {states}"
        workers = {client.get_job(job_id).worker_id for job_id in ids}
        assert len(workers) == 1  # one worker, two slots, two jobs
    finally:
        for job_id in ids:
            client.cancel(job_id, reason="test over")
    for job_id in ids:
        for _ in client.watch(job_id, timeout=60):
            pass
        assert client.get_job(job_id).state == "CANCELLED"
    assert not mesh.dead_processes()


async def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


def spare_settings(tmp_path: Path, **options) -> WorkerSettings:
    return WorkerSettings(worker_token="unused", run_root=tmp_path, stop_grace_s=2, **options)


def test_the_pool_replaces_a_dead_spare_and_a_spare_without_a_job_exits_cleanly(
    tmp_path: Path, letter_model_dir: Path
) -> None:
    async def scenario() -> None:
        pool = SparePool(spare_settings(tmp_path, warm_models=[str(letter_model_dir)]))
        stop = asyncio.Event()
        maintainer = asyncio.create_task(pool.maintain(stop, interval_s=0.2))
        try:
            await _until(lambda: all(len(v) == 1 for v in pool.waiting().values()))
            (dead,) = pool.waiting()["rollout"]
            os.kill(dead.pid, signal.SIGKILL)
            await _until(lambda: [p.pid for p in pool.waiting()["rollout"]] not in ([], [dead.pid]))
            assert pool.waiting()["rollout"][0].running

            taken = pool.take("trainer", str(letter_model_dir))
            assert taken is not None and pool.warm_starts == 1
            await _until(lambda: len(pool.waiting()["trainer"]) == 1)  # its replacement
            await _until(lambda: "spare_ready" in taken.log_path.read_text(), timeout_s=120)
            taken.close_stdin()  # no job after all: it exits by itself, code 0
            assert await asyncio.wait_for(taken.wait(), 30) == 0
            assert "spare_retired" in taken.log_path.read_text()
        finally:
            stop.set()
            await maintainer
            await pool.close()
        assert pool.waiting() == {"rollout": [], "trainer": []}

    asyncio.run(scenario())


def test_spares_of_a_model_no_job_asked_for_lately_are_retired(tmp_path: Path) -> None:
    async def scenario() -> None:
        pool = SparePool(spare_settings(tmp_path, spare_idle_s=1.0))
        assert pool.take("rollout", "some/model") is None  # no spare yet: the job starts cold
        stop = asyncio.Event()
        maintainer = asyncio.create_task(pool.maintain(stop, interval_s=0.2))
        try:
            await _until(lambda: len(pool.waiting()["rollout"]) == 1)
            (spare,) = pool.waiting()["rollout"]
            await _until(lambda: not pool.waiting()["rollout"], timeout_s=30)
            await asyncio.wait_for(spare.wait(), 30)  # stopped, not left behind
        finally:
            stop.set()
            await maintainer
            await pool.close()

    asyncio.run(scenario())
