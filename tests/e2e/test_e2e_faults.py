"""Faults survived, end to end: the real mesh as processes (Redis, scheduler, EnvHub, worker,
and the trainer + rollout the worker starts). A trainer SIGKILLed in the middle of an RL job is
an infrastructure fault: the job is re-queued, the next attempt resumes from the last complete
checkpoint (its steps never go back past it) and the job ends SUCCEEDED."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from fault_report import record_fault
from ledger_helpers import assert_no_double_lease

import opentinker
from opentinker import JobSpec, LoraConfig, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 12  # steps of ~40-100 ms: the kill after step 3 lands well before the end
CHECKPOINT_EVERY = 2
KILL_AFTER_STEP = 3  # one step past the step-2 checkpoint


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with LocalMesh(MeshSettings(run_root=tmp_path_factory.mktemp("faults"))) as running:
        yield running


def job(model: Path) -> JobSpec:
    rl = RlConfig(
        env_name="letter",
        env_options={"num_letters": "4"},
        steps=STEPS,
        checkpoint_every=CHECKPOINT_EVERY,
        prompts_per_step=2,
        samples_per_prompt=4,
        learning_rate=1e-2,
        sampling=SamplingParams(max_new_tokens=1),
        seed=5,
    )
    model_spec = ModelSpec(base_model=str(model), finetune="lora", lora=LoraConfig(rank=4))
    return JobSpec(name="e2e-trainer-killed", model=model_spec, rl=rl)


def run_and_kill(mesh, spec: JobSpec, kill) -> tuple[opentinker.JobInfo, list, int]:
    """Submit ``spec``, call ``kill(job_id)`` once a step >= KILL_AFTER_STEP is reported,
    follow the job to its end; (final job, every event, the step seen when killing)."""
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
        job_id = client.submit(spec).job_id
        events, killed_at = [], 0
        for event in client.watch(job_id, timeout=540):
            events.append(event)
            if event.kind == "step" and event.step >= KILL_AFTER_STEP and not killed_at:
                kill(job_id)
                killed_at = event.step
        return client.get_job(job_id), events, killed_at


def assert_resumed(final, events: list, killed_at: int, lost: str) -> None:
    """One lost attempt (``lost`` in the re-queue reason), then a second that resumed from the
    last complete checkpoint of the first and ran to the end."""
    assert final.state == "SUCCEEDED", final.reason
    assert final.attempt == 2
    states = [e for e in events if e.kind == "state"]
    requeued = next(e for e in states if e.state == "QUEUED" and e.seq > states[0].seq)
    assert lost in requeued.reason and requeued.reason.endswith("; re-queued"), requeued.reason
    before = [e.step for e in events if e.kind == "step" and e.seq < requeued.seq]
    after = [e for e in events if e.kind == "step" and e.seq > requeued.seq]
    (resumed,) = [e.message for e in events if e.kind == "log" and e.seq > requeued.seq]
    match = re.match(r"resumed from checkpoint step-(\d+) \(step (\d+),", resumed)
    assert match is not None, resumed
    checkpoint_step = int(match.group(2))
    # the checkpoint is the last one attempt 1 completed: a multiple of checkpoint_every, at
    # most one interval behind its last step (the one being written may be lost), never step 0
    assert before == list(range(1, len(before) + 1)) and before[-1] >= killed_at
    assert checkpoint_step % CHECKPOINT_EVERY == 0
    assert before[-1] - CHECKPOINT_EVERY <= checkpoint_step <= before[-1]
    assert checkpoint_step >= KILL_AFTER_STEP - 1
    # the new attempt starts right after it and goes on to the end, versions in step
    assert [e.step for e in after] == list(range(checkpoint_step + 1, STEPS + 1))
    assert [e.policy_version for e in after] == [e.step for e in after]
    assert final.final_metrics["steps"] == STEPS


def test_a_sigkilled_trainer_resumes_from_its_last_checkpoint(mesh, letter_model_dir) -> None:
    def kill_trainer(job_id: str) -> None:
        # The worker writes the pid of each process of an attempt, cold or handed to a spare.
        pid_file = mesh.run_root / "jobs" / job_id / "attempt-1" / "trainer.pid"
        pid = int(pid_file.read_text())
        assert b"opentinker.services.trainer" in Path(f"/proc/{pid}/cmdline").read_bytes()
        os.kill(pid, signal.SIGKILL)

    final, events, killed_at = run_and_kill(mesh, job(letter_model_dir), kill_trainer)
    assert_resumed(final, events, killed_at, "trainer process was killed by signal 9 (SIGKILL)")
    assert_no_double_lease(mesh.redis_url, final.job_id, attempts=2)

    # the final checkpoint is in the job's checkpoint folder, a PEFT adapter that loads
    folder = mesh.run_root / "jobs" / "checkpoints" / final.job_id
    assert Path(final.checkpoint_uri) == folder / f"step-{STEPS:06d}"
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{s:06d}" for s in (STEPS - 2, STEPS)]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(letter_model_dir))
    PeftModel.from_pretrained(base, final.checkpoint_uri)
    assert not mesh.dead_processes()
    assert_takes_new_jobs(mesh, letter_model_dir)
    record_fault("trainer", "resumed from its last checkpoint; 2 leases, never at once")


def test_a_sigkilled_rollout_resumes_from_its_last_checkpoint(mesh, letter_model_dir) -> None:
    def kill_rollout(job_id: str) -> None:
        pid_file = mesh.run_root / "jobs" / job_id / "attempt-1" / "rollout.pid"
        pid = int(pid_file.read_text())
        assert b"opentinker.services.rollout" in Path(f"/proc/{pid}/cmdline").read_bytes()
        os.kill(pid, signal.SIGKILL)

    final, events, killed_at = run_and_kill(mesh, job(letter_model_dir), kill_rollout)
    assert_resumed(final, events, killed_at, "rollout process was killed by signal 9 (SIGKILL)")
    assert_no_double_lease(mesh.redis_url, final.job_id, attempts=2)
    assert_takes_new_jobs(mesh, letter_model_dir)
    record_fault("rollout", "resumed from its last checkpoint; 2 leases, never at once")


def assert_takes_new_jobs(mesh, model: Path) -> None:  # noqa: ANN001
    short = job(model).model_copy(update={"rl": job(model).rl.model_copy(update={"steps": 1})})
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
        done = client.fit(short, timeout=300)
    assert done.state == "SUCCEEDED" and done.attempt == 1


def test_a_sigkilled_worker_agent_is_replaced_and_its_job_resumes(mesh, letter_model_dir) -> None:
    (worker,) = [p for p in mesh.processes if p.name == "worker" and p.alive()]
    ids: list[str] = []

    def kill_worker(job_id: str) -> None:
        # the agent's default worker id, kept in its run root (worker/worker_id.py) since it
        # started (read now: it runs a job, so it has)
        ids.append((mesh.run_root / "jobs" / "worker.id").read_text().strip())
        os.kill(worker.process.pid, signal.SIGKILL)  # its trainer and rollout die with it
        worker.process.wait(timeout=10)
        mesh.start_worker()  # a new agent on the same node: the same worker id, admitted

    final, events, killed_at = run_and_kill(mesh, job(letter_model_dir), kill_worker)
    (lost_id,) = ids
    assert_resumed(final, events, killed_at, f"worker {lost_id} lost")
    assert_no_double_lease(mesh.redis_url, final.job_id, attempts=2)
    assert final.worker_id == lost_id  # the restarted agent ran attempt 2, under its old id
    assert_takes_new_jobs(mesh, letter_model_dir)
    record_fault("worker agent", "replaced; job resumed from its checkpoint; no double lease")
