"""Storage faults of the checkpoint root are named, and checkpoints are never left half-made.

A full disk (a small tmpfs), a read-only root (a tmpfs mounted read-only) and a root the
trainer may not write (a 0o555 folder; as root, the check runs with CAP_DAC_OVERRIDE dropped)
give a StorageError (a session's SaveState: the matching status) that says disk full /
read-only / permission denied with the path and the free space, at a save or before step 1;
a prune killed mid-way leaves no half-deleted ``step-N``; what killed attempts left half-made
is deleted at the next attempt and never loaded. Through the real loops: an RL job on a
read-only root fails before step 1, an SFT job on a full disk with on_storage_error=requeue
ends its attempt to be re-queued (exit 75); through the real mesh, that exit re-queues the
job until max_attempts, every reason naming the read-only root.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from identity_service import Identities
from sft_helpers import answer_format_rows, write_jsonl
from trainer_loop_helpers import job_spec, mesh, run_attempt, run_sft

import opentinker
from opentinker.errors import FailedPreconditionError, ResourceExhaustedError
from opentinker.services.common.exit_codes import RETRY_LATER
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.job_types import Outcome
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.session import state as session_state
from opentinker.services.trainer.storage import StorageError
from opentinker.spec import JobSpec, LoraConfig, ModelSpec, SftConfig

pytestmark = pytest.mark.integration  # real tiny model, real filesystems


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@contextmanager
def small_filesystem(path: Path, *, size: str, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path`` (read-only: mounted so, empty), unmounted at the end;
    the test is skipped, saying why, where this machine cannot mount one."""
    path.mkdir(parents=True)
    options = f"size={size}" + (",ro" if read_only else "")
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a small filesystem here (mount: {err}); needs root")
    if done.returncode != 0:
        # A loop-mounted image needs the same privilege (CAP_SYS_ADMIN) a tmpfs does.
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.strip()}; needs root")
    try:
        yield path
    finally:
        gc.collect()  # a loaded checkpoint's tensors may map its files (safetensors)
        if subprocess.run(["umount", str(path)], check=False, timeout=30).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=False, timeout=30)


def stepped(spec: ModelSpec) -> Policy:
    """A policy after one AdamW step: its checkpoints hold both moments of every weight."""
    torch.manual_seed(3)
    policy = Policy(spec, learning_rate=1e-2)
    loss = sum(p.float().square().sum() for p in policy.trainable_parameters())
    loss.backward()  # type: ignore[union-attr]
    policy.optimizer.step()
    return policy


def state_at(step: int) -> checkpoints.TrainerState:
    return checkpoints.TrainerState(
        job_id="job-s", step=step, policy_version=step, rewards=[0.0] * step, data_cursor=step
    )


def test_a_full_disk_is_named_with_the_path_and_the_free_space(
    model_dir: Path, tmp_path: Path
) -> None:
    """The issue: 'RuntimeError: [enforce fail at inline_container.cc:672] unexpected pos …',
    nothing saying the disk is full. One checkpoint of the full fine-tune (~6.8 MB) fits the
    10 MB disk, the second does not: torch's own writer runs out (optimizer.pt)."""
    policy = stepped(ModelSpec(base_model=str(model_dir), finetune="full"))
    with small_filesystem(tmp_path / "disk", size="10m") as disk:
        folder = disk / "job-s"
        first = checkpoints.save(policy, state_at(1), folder, keep=2)
        with pytest.raises(StorageError) as caught:
            checkpoints.save(policy, state_at(2), folder, keep=2)
        message = str(caught.value)
        assert caught.value.reason == "DISK_FULL"
        assert message.startswith("disk full: could not write checkpoint"), message
        assert str(folder / "step-000002") in message
        assert "free of 10.0 MiB on the filesystem of" in message, message
        # the last good one stays, whole and loadable; the half-written one is gone
        assert checkpoints.latest(folder) == first
        assert sorted(p.name for p in folder.iterdir()) == ["step-000001"]
        checkpoints.load(Policy(policy.spec, learning_rate=1e-2), first)
        # and before training, the same disk is refused for a checkpoint it cannot hold
        with pytest.raises(StorageError, match=r"^disk full: a checkpoint in .* needs at least"):
            checkpoints.prepare(folder, need_bytes=checkpoints.size_lower_bound(policy))


def test_a_read_only_root_is_named_before_and_at_a_save(model_dir: Path, tmp_path: Path) -> None:
    policy = stepped(ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig()))
    with small_filesystem(tmp_path / "ro", size="1m", read_only=True) as root:
        folder = root / "job-s"
        with pytest.raises(StorageError) as before:
            checkpoints.prepare(folder)
        with pytest.raises(StorageError) as at_save:
            checkpoints.save(policy, state_at(1), folder, keep=2)
    for caught in (before, at_save):
        message = str(caught.value)
        assert caught.value.reason == "READ_ONLY"
        assert message.startswith("read-only file system: "), message
        assert str(folder) in message and "free of 1.0 MiB" in message, message


_FORBIDDEN = """
import sys
from pathlib import Path
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.storage import StorageError
from opentinker.spec import ModelSpec
folder = Path(sys.argv[2]) / "job-s"
policy = Policy(ModelSpec(base_model=sys.argv[1], finetune="lora"), learning_rate=1e-2)
state = checkpoints.TrainerState(job_id="job-s", step=1, policy_version=1, data_cursor=1)
def save():
    checkpoints.save(policy, state, folder, keep=2)
for attempt in (lambda: checkpoints.prepare(folder), save):
    try:
        attempt()
    except StorageError as err:
        print("NAMED", err.reason, err)
"""


def test_a_root_the_trainer_may_not_write_is_named(model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "forbidden"
    root.mkdir()
    root.chmod(0o555)
    script = tmp_path / "forbidden.py"
    script.write_text(_FORBIDDEN)
    command = [sys.executable, str(script), str(model_dir), str(root)]
    if os.geteuid() == 0:  # root writes anywhere: drop the capability that lets it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot drop CAP_DAC_OVERRIDE")
        command = ["setpriv", "--bounding-set", "-dac_override", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    named = [line for line in done.stdout.splitlines() if line.startswith("NAMED")]
    assert len(named) == 2, done.stdout
    for line in named:
        assert line.startswith("NAMED PERMISSION_DENIED permission denied: "), line
        assert str(root / "job-s") in line and "free of" in line, line


class Killed(BaseException):
    """What a SIGKILL does to a delete: it stops part-way (raised from inside rmtree)."""


def test_a_prune_killed_mid_delete_leaves_no_half_deleted_checkpoint(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue: SIGKILL 0-4 ms after a new checkpoint was renamed in, while the old ones
    were pruned, left a `step-N` folder with its manifest and a file gone, for good."""
    policy = stepped(ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig()))
    folder = tmp_path / "job-s"
    for step in (1, 2):
        checkpoints.save(policy, state_at(step), folder, keep=2)
    real_rmtree = shutil.rmtree

    def killed_after_one_file(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if not Path(path).is_dir() or ".tmp-" in Path(path).name:  # not a prune's delete
            return real_rmtree(path, *args, **kwargs)
        victim = next(p for p in sorted(Path(path).iterdir()) if p.name != checkpoints.MANIFEST)
        victim.unlink()
        raise Killed(path)

    monkeypatch.setattr(checkpoints.shutil, "rmtree", killed_after_one_file)
    with pytest.raises(Killed):
        checkpoints.save(policy, state_at(3), folder, keep=2)  # prunes step-000001
    monkeypatch.setattr(checkpoints.shutil, "rmtree", real_rmtree)

    published = [p for p in folder.iterdir() if not p.name.startswith(".")]
    assert sorted(p.name for p in published) == ["step-000002", "step-000003"]
    assert all(checkpoints.is_complete(p) for p in published)
    removed = checkpoints.prepare(folder)  # the next attempt
    assert [p.name for p in removed] == [f".step-000001.del-{os.getpid()}"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-000002", "step-000003"]


def plant_half_made(folder: Path, good: Path) -> list[str]:
    """What kills leave: a half-deleted step (manifest, a file gone; by an older version's
    prune), a step folder without its manifest, a half-written and a half-deleted hidden one."""
    half_deleted = folder / "step-000005"
    shutil.copytree(good, half_deleted)
    files = json.loads((half_deleted / checkpoints.MANIFEST).read_text())["files"]
    (half_deleted / sorted(files)[0]).unlink()
    no_manifest = folder / "step-000006"
    shutil.copytree(good, no_manifest)
    (no_manifest / checkpoints.MANIFEST).unlink()
    shutil.copytree(good, folder / ".step-000007.tmp-4242")
    (folder / ".step-000007.tmp-4242" / checkpoints.MANIFEST).unlink()
    shutil.copytree(good, folder / ".step-000001.del-4242")
    return [".step-000001.del-4242", ".step-000007.tmp-4242", "step-000005", "step-000006"]


def test_half_made_folders_are_never_loaded_and_are_removed_at_the_next_attempt(
    model_dir: Path, tmp_path: Path
) -> None:
    policy = stepped(ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig()))
    folder = tmp_path / "job-s"
    good = checkpoints.save(policy, state_at(2), folder, keep=2)
    planted = plant_half_made(folder, good)
    (folder / "step-notes").mkdir()  # not a checkpoint's name: left alone
    assert checkpoints.latest(folder) == good  # never loaded
    removed = checkpoints.prepare(folder)
    assert sorted(p.name for p in removed) == planted
    assert sorted(p.name for p in folder.iterdir()) == ["step-000002", "step-notes"]
    assert checkpoints.load(policy, good) == state_at(2)


# ---- through the real loops ---------------------------------------------------------------


def test_an_rl_job_on_a_read_only_root_fails_before_its_first_step(
    identities: Identities, model_dir: Path, tmp_path: Path
) -> None:
    """The issue: checkpoint_every=0 on a read-only root trained all its steps, then failed
    at the final save."""
    spec = job_spec(model_dir, steps=3, checkpoint_every=0)

    async def scenario() -> None:
        with small_filesystem(tmp_path / "ro", size="1m", read_only=True) as root:
            async with mesh(identities, job_id="job-1") as m:
                attempt = await run_attempt(m, spec, tmp_path / "run", root / "job-1")
                assert attempt.outcome is Outcome.FAILED
                assert m.scheduler.of("step") == []  # not one step trained
                (failure,) = m.scheduler.of("failure")
        assert failure.reason.startswith("read-only file system: the checkpoint folder ")
        assert str(root / "job-1") in failure.reason and "free of" in failure.reason

    asyncio.run(scenario())


def sft_spec(model_dir: Path, data: Path) -> JobSpec:
    sft = SftConfig(
        dataset_path=str(data),
        steps=2,
        max_tokens_per_batch=256,
        max_sequence_length=64,
        validation_fraction=0.2,
    )
    return JobSpec(kind="sft", model=ModelSpec(base_model=str(model_dir), finetune="full"), sft=sft)


def test_an_sft_job_on_a_full_disk_is_requeued_as_the_operator_chose(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "rows.jsonl", answer_format_rows(20))
    monkeypatch.setenv("OPENTINKER_TRAINER_ON_STORAGE_ERROR", "requeue")  # the operator's
    with small_filesystem(tmp_path / "disk", size="32k") as disk:
        outcome, recorder = run_sft(sft_spec(model_dir, data), disk / "sft-1")
    reports = recorder.reports
    assert outcome is Outcome.RETRY_LATER and outcome.exit_code == RETRY_LATER
    kinds = [r.WhichOneof("payload") for r in reports]
    assert kinds == ["failure"], kinds  # before step 1
    reason = reports[0].failure.reason
    assert reason.startswith("disk full: "), reason
    assert str(disk / "sft-1") in reason and "free of 32.0 KiB" in reason, reason
    assert reason.endswith("the job is re-queued (on_storage_error=requeue)"), reason


def test_an_sft_attempt_removes_what_killed_attempts_left_and_trains_from_the_start(
    model_dir: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "rows.jsonl", answer_format_rows(20))
    folder = tmp_path / "sft-1"
    # a checkpoint of another job, made whole, then broken the ways kills break them
    policy = stepped(ModelSpec(base_model=str(model_dir), finetune="full"))
    donor = checkpoints.save(policy, state_at(4), tmp_path / "donor", keep=1)
    folder.mkdir()
    plant_half_made(folder, donor)
    outcome, recorder = run_sft(sft_spec(model_dir, data), folder)
    assert outcome is Outcome.SUCCEEDED, recorder.of("failure")
    steps = [s.step for s in recorder.of("step")]
    assert steps == [1, 2]  # from step 0: nothing half-made was loaded
    assert sorted(p.name for p in folder.iterdir()) == ["step-000002"]


def test_a_session_save_state_names_the_fault_as_a_status(model_dir: Path, tmp_path: Path) -> None:
    """SaveState shares the checkpoint code: a full disk is RESOURCE_EXHAUSTED, a read-only
    root FAILED_PRECONDITION, each saying which fault, where, and the free space."""
    spec = ModelSpec(base_model=str(model_dir), finetune="full")
    policy = stepped(spec)
    owner = session_state.SavedSession(tenant_id="acme", job_id="sess-1", model=spec, step=1)
    with (
        small_filesystem(tmp_path / "ro", size="1m", read_only=True) as root,
        pytest.raises(FailedPreconditionError) as read_only,
    ):
        session_state.save_state(policy, root=root, name="s1", owner=owner)
    with small_filesystem(tmp_path / "disk", size="1m") as root:
        with pytest.raises(ResourceExhaustedError) as full:
            session_state.save_state(policy, root=root, name="s1", owner=owner)
        assert not list((root / "sess-1" / "states" / "s1").iterdir())  # nothing half-made
    assert read_only.value.reason == "READ_ONLY" and full.value.reason == "DISK_FULL"
    assert read_only.value.message.startswith("read-only file system: could not ")
    assert full.value.message.startswith("disk full: could not write checkpoint ")
    assert "free of 1.0 MiB" in full.value.message and "sess-1/states/s1" in full.value.message


@pytest.mark.slow
def test_through_the_mesh_a_read_only_root_requeues_then_fails_naming_it(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real mesh (Redis, scheduler, worker, trainer processes) on a read-only checkpoint
    root, the operator's choice requeue: each attempt ends before step 1 with exit 75, the
    worker passes it on, the scheduler re-queues, and after max_attempts the job fails with
    every attempt's reason naming the fault and the path."""
    run_root = tmp_path / "mesh"
    monkeypatch.setenv("OPENTINKER_TRAINER_ON_STORAGE_ERROR", "requeue")  # the trainers'
    data = write_jsonl(tmp_path / "rows.jsonl", answer_format_rows(20))
    spec = sft_spec(model_dir, data)
    with (
        small_filesystem(run_root / "jobs" / "checkpoints", size="1m", read_only=True) as root,
        LocalMesh(MeshSettings(run_root=run_root, warm_spares=0)) as running,
        opentinker.Client(running.scheduler_address, api_key=running.api_key, timeout=10) as c,
    ):
        assert running.checkpoint_root == root
        job_id = c.submit(spec).job_id
        events = list(c.watch(job_id, timeout=400))
        final = c.get_job(job_id)
    assert final.state == "FAILED", final.reason
    assert not [e for e in events if e.kind == "step"]  # no attempt trained a step
    requeued = [e.reason for e in events if e.kind == "state" and e.state == "QUEUED"][1:]
    assert requeued, [(e.kind, e.reason) for e in events]
    for reason in [*requeued, final.reason]:
        assert f"read-only file system: the checkpoint folder {root / job_id}" in reason, reason
        assert "the job is re-queued (on_storage_error=requeue)" in reason, reason
    assert final.reason.startswith(f"gave up after {final.attempt} attempts: 1: read-only")
