"""Warm spares reused across one tenant's jobs (worker/spares.py, reusable.py,
modeling/spare.py ``serve_jobs``), through the real mesh with the tiny model.

A spare whose job ended well is kept for the next job of the same tenant and base model: that
job pays no process start. It must start exactly as a fresh process would (the base model
loaded again, its own seed), and never serve another tenant."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from identity_helpers import other_tenant_key

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    settings = MeshSettings(run_root=tmp_path_factory.mktemp("reuse"), cpu_slots=1, warm_spares=1)
    with LocalMesh(settings) as running:
        yield running


def full_job(model: Path, *, seed: int = 3) -> JobSpec:
    """Full fine-tuning with a large learning rate: a step changes the weights a lot."""
    rl = RlConfig(
        env_name="letter",
        env_options={"num_letters": "4"},
        steps=1,
        prompts_per_step=2,
        samples_per_prompt=4,
        learning_rate=5e-2,
        sampling=SamplingParams(max_new_tokens=1),
        seed=seed,
    )
    return JobSpec(name="reuse", model=ModelSpec(base_model=str(model), finetune="full"), rl=rl)


def lora_job(model: Path, *, seed: int = 3) -> JobSpec:
    """The same with LoRA (the default): a spare keeps the wrapped model (kept_wrap.py)."""
    spec = full_job(model, seed=seed)
    return spec.model_copy(update={"model": ModelSpec(base_model=str(model))})


def run(client: opentinker.Client, spec: JobSpec) -> tuple[str, dict[str, float]]:
    events: list = []
    job = client.fit(spec, on_event=events.append, timeout=300)
    return job.job_id, [e for e in events if e.kind == "step"][0].metrics


def pids(mesh: LocalMesh, job_id: str) -> dict[str, int]:
    run_dir = mesh.run_root / "jobs" / job_id / "attempt-1"
    return {name: int((run_dir / f"{name}.pid").read_text()) for name in ("rollout", "trainer")}


def until_logged(paths, text: str, count: int, timeout_s: float = 120.0) -> None:
    """Until the files ``paths()`` names say ``text`` ``count`` times in all."""
    deadline = time.monotonic() + timeout_s
    while sum(p.read_text().count(text) for p in paths()) < count:
        assert time.monotonic() < deadline, f"fewer than {count} {text!r} in {paths()}"
        time.sleep(0.2)


def test_a_tenants_next_job_runs_on_its_last_jobs_processes_from_fresh_weights(
    mesh, letter_model_dir
) -> None:
    spares = mesh.run_root / "jobs" / "spares"
    spare_logs = lambda: list(spares.glob("*.log"))  # noqa: E731
    worker_log = lambda: [mesh.log_dir / "worker.log"]  # noqa: E731
    spec = full_job(letter_model_dir)
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
        run(client, spec)  # the worker learns the model: spares are made for it
        until_logged(spare_logs, "spare_ready", 2)  # a rollout and a trainer
        first_id, first = run(client, spec)  # on fresh spares, kept afterwards
        until_logged(worker_log, "spare_kept", 2)
        again_id, again = run(client, spec)
    assert pids(mesh, again_id) == pids(mesh, first_id), "not the kept processes"
    # The kept processes trained every parameter with a large step; had any of it (or the
    # optimizer, or the RNG) reached the next job, its first step would differ from the
    # first's. Same spec and seed from the base weights: the same numbers.
    assert first["grad_norm"] > 0
    for key in ("reward_mean", "entropy", "loss", "grad_norm", "probe_max_abs_diff"):
        assert again[key] == pytest.approx(first[key], rel=1e-5, abs=1e-7), key

    # Another tenant's job never gets them.
    kept = set(pids(mesh, again_id).values())
    with opentinker.Client(
        mesh.scheduler_address, api_key=other_tenant_key(mesh, "reuse-other", "carol")
    ) as other:
        other_id, _ = run(other, spec)
    assert not kept & set(pids(mesh, other_id).values()), "another tenant's job reused them"


def test_a_tenants_next_lora_job_gets_the_kept_wrapped_model_with_a_fresh_adapter(
    mesh, letter_model_dir
) -> None:
    """The kept processes keep the LoRA job's wrapped model (no base read again, no wrap);
    the next job's adapter is made anew from its own seed: its first step is the last's."""
    worker_log = lambda: [mesh.log_dir / "worker.log"]  # noqa: E731
    spec = lora_job(letter_model_dir)
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
        kept = (mesh.log_dir / "worker.log").read_text().count("spare_kept")
        first_id, first = run(client, spec)
        until_logged(worker_log, "spare_kept", kept + 2)
        again_id, again = run(client, spec)
    assert pids(mesh, again_id) == pids(mesh, first_id), "not the kept processes"
    run_dir = mesh.run_root / "jobs" / again_id / "attempt-1"
    for name in ("trainer", "rollout"):  # the kept wrap, its adapter made anew
        assert "event='adapter_reset'" in (run_dir / f"{name}.log").read_text(), name
    assert first["grad_norm"] > 0
    for key in ("reward_mean", "entropy", "loss", "grad_norm", "probe_max_abs_diff"):
        assert again[key] == pytest.approx(first[key], rel=1e-5, abs=1e-7), key


def test_a_used_spare_goes_only_to_its_tenant_on_the_same_devices(tmp_path: Path) -> None:
    """A process that served tenant t on GPU 0 has initialised CUDA there: a job of t leased
    GPU 1 must not get it (its hand-over would be refused); a job of t on GPU 0 does. The kept
    process is a real child (``cat``, which writes what it is handed to its log)."""
    import asyncio

    import structlog

    from opentinker.common.v1 import common_pb2
    from opentinker.services.modeling.spare import Handover
    from opentinker.services.worker.reusable import hand_to_spare
    from opentinker.services.worker.settings import WorkerSettings
    from opentinker.services.worker.spares import SparePool
    from opentinker.services.worker.supervisor import ManagedProcess

    job = common_pb2.Job(job_id="j", tenant_id="t")
    job.spec.kind = common_pb2.JOB_KIND_RL
    job.spec.model.base_model = "m"
    log_path = tmp_path / "kept.log"

    def handover(devices: str) -> Handover:
        return Handover(launch=tmp_path / "l", log_path=log_path, cuda_visible_devices=devices)

    async def main() -> None:
        pool = SparePool(WorkerSettings(run_root=tmp_path, warm_spares=1))
        kept = await ManagedProcess.start(
            "kept", ["cat"], log_path=log_path, env={}, stdin_pipe=True, report_pipe="FD"
        )
        try:
            pool.take("trainer", "m")  # the pool knows the model (no fresh spare made here)
            pool.give_back("trainer", "m", "t@0", kept)
            log = structlog.get_logger()
            other = await hand_to_spare(pool, "trainer", job, handover("1"), True, log)
            assert other is None, "a job on GPU 1 got the process that used GPU 0"
            same = await hand_to_spare(pool, "trainer", job, handover("0"), True, log)
            assert same is not None and same.pid == kept.pid
            await asyncio.sleep(0.2)
            assert log_path.read_text().count('"cuda_visible_devices":"0"') == 1
        finally:
            await kept.terminate(1.0)

    asyncio.run(main())


def test_a_tenant_keeps_a_pair_for_each_job_it_can_run_at_once(tmp_path: Path) -> None:
    """On CPU slots a tenant's concurrent jobs each give their processes back: as many are
    kept as the worker runs jobs at once (4 slots, warm_spares 1); one more is ended. On a
    GPU a device runs one job: one is kept."""
    import asyncio

    from opentinker.services.worker.settings import WorkerSettings
    from opentinker.services.worker.spares import SparePool
    from opentinker.services.worker.supervisor import ManagedProcess

    async def main() -> None:
        settings = WorkerSettings(run_root=tmp_path, warm_spares=1, num_cpu_slots=4)
        pool = SparePool(settings)
        assert pool.kept_limit(on_cpu=True) == 4 and pool.kept_limit(on_cpu=False) == 1
        processes = [
            await ManagedProcess.start(
                f"p{i}", ["cat"], log_path=tmp_path / f"p{i}.log", env={}, stdin_pipe=True
            )
            for i in range(5)
        ]
        try:
            pool.take("trainer", "m")  # the pool knows the model
            for process in processes:
                pool.give_back("trainer", "m", "t@", process, limit=pool.kept_limit(on_cpu=True))
            kept = [pool.take("trainer", "m", tenant="t@") for _ in range(4)]
            assert [p.pid for p in kept if p] == [p.pid for p in processes[:4]]
            await asyncio.wait_for(processes[4].wait(), timeout=10)  # the fifth was ended
        finally:
            for process in processes:
                await process.terminate(1.0)

    asyncio.run(main())
