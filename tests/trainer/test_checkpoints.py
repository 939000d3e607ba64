"""Trainer checkpoints: a round trip restores weights, AdamW state and RNG state; a checkpoint
without a valid manifest is never loaded; only the newest ``keep`` survive."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.errors import CheckpointError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.training import grpo_update
from opentinker.spec import LoraConfig, ModelSpec

pytestmark = pytest.mark.integration  # real tiny model on disk, loaded with from_pretrained


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def lora(model_dir: Path) -> ModelSpec:
    return ModelSpec(
        base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=4, dropout=0.1)
    )


def full(model_dir: Path) -> ModelSpec:
    return ModelSpec(base_model=str(model_dir), finetune="full")


def trained(spec: ModelSpec, steps: int = 2) -> Policy:
    """A policy after ``steps`` GRPO updates (AdamW then has moments for every parameter)."""
    torch.manual_seed(3)
    policy = Policy(spec, learning_rate=1e-2)
    prompt = policy.probe_token_ids[:12]
    for _ in range(steps):
        episodes = []
        for reward, completion in ((1.0, [65]), (0.0, [66, 67])):
            ids = prompt + completion
            old = policy.probe_logprobs(ids)[len(prompt) - 1 :]
            episodes.append(
                Episode(0, 0, ids, len(prompt), old, [1] * len(completion), reward, False)
            )
        stats = grpo_update(policy, episodes, clip_epsilon=0.2, temperature=1.0)
        assert stats.grad_norm > 0  # a real update happened
    return policy


def state_at(step: int) -> checkpoints.TrainerState:
    rewards = [0.25 * (i % 4) for i in range(step)]
    return checkpoints.TrainerState(
        job_id="job-c", step=step, policy_version=step, rewards=rewards, data_cursor=step
    )


def assert_same_training_state(a: Policy, b: Policy) -> None:
    for (name, x), y in zip(a.trainable_state().items(), b.trainable_state().values(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for key, moments in sa["state"].items():
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[field], sb["state"][key][field]), (key, field)


@pytest.mark.parametrize("make_spec", [lora, full], ids=["lora", "full"])
def test_a_round_trip_restores_weights_optimizer_and_rng(
    make_spec, tiny_model_dir: Path, tmp_path: Path
) -> None:
    policy = trained(make_spec(tiny_model_dir))
    random.seed(11)
    path = checkpoints.save(policy, state_at(2), tmp_path, keep=2)
    assert path == (tmp_path / "step-000002").resolve() and checkpoints.is_complete(path)
    expected_draws = (torch.rand(3), random.random())

    torch.manual_seed(99)  # a fresh process: other seed, other LoRA init, fresh AdamW
    random.seed(99)
    fresh = Policy(make_spec(tiny_model_dir), learning_rate=1e-2)
    state = checkpoints.load(fresh, path)
    assert state == state_at(2)
    assert_same_training_state(policy, fresh)
    draws = (torch.rand(3), random.random())
    assert torch.equal(draws[0], expected_draws[0]) and draws[1] == expected_draws[1]
    # and it is still a plain HF / PEFT checkpoint
    if fresh.is_lora:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        assert any(
            "lora_" in n for n, _ in PeftModel.from_pretrained(base, path).named_parameters()
        )
    else:
        AutoModelForCausalLM.from_pretrained(path)


def test_incomplete_checkpoints_are_never_loaded(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = trained(lora(tiny_model_dir), steps=1)
    good = checkpoints.save(policy, state_at(2), tmp_path, keep=5)
    for step, damage in ((4, "no manifest"), (6, "truncated"), (8, "bad manifest")):
        bad = checkpoints.save(policy, state_at(step), tmp_path, keep=5)
        if damage == "no manifest":  # e.g. copied by hand, or a rename of a half-done folder
            (bad / checkpoints.MANIFEST).unlink()
        elif damage == "truncated":
            optimizer = bad / checkpoints.OPTIMIZER
            optimizer.write_bytes(optimizer.read_bytes()[:100])
        else:
            (bad / checkpoints.MANIFEST).write_text("{not json")
        assert not checkpoints.is_complete(bad)
    # a temporary folder a killed attempt was writing: complete-looking, but hidden
    partial = tmp_path / ".step-000010.tmp-4242"
    partial.mkdir()
    (partial / checkpoints.MANIFEST).write_text(json.dumps({"step": 10, "files": {}}))

    assert checkpoints.latest(tmp_path) == good
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoints.load(policy, tmp_path / "step-000004")
    # what a kill can leave is deleted by the next attempt: every folder that can never load
    removed = checkpoints.remove_partial(tmp_path)
    assert sorted(p.name for p in removed) == [partial.name] + [
        checkpoints.step_name(step) for step in (4, 6, 8)
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]
    assert checkpoints.latest(tmp_path / "nothing-here") is None


@pytest.mark.parametrize("new_complete", [True, False], ids=["new-complete", "new-partial"])
def test_a_save_killed_while_replacing_a_step_leaves_one_in_place(
    new_complete: bool, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Replacing step 3, the save moved the old one aside and was killed before moving the new
    # one in: no step-000003, only the two hidden folders (built here as they would be left).
    policy = trained(lora(tiny_model_dir), steps=1)
    old_state = state_at(3)
    new_state = old_state.model_copy(update={"rewards": [1.0, 1.0, 1.0]})
    final = checkpoints.save(policy, old_state, tmp_path, keep=5)
    final.rename(tmp_path / ".step-000003.old-777")
    written = checkpoints.save(policy, new_state, tmp_path / "scratch", keep=1)
    written.rename(tmp_path / ".step-000003.tmp-777")
    if not new_complete:
        (tmp_path / ".step-000003.tmp-777" / checkpoints.MANIFEST).unlink()
    assert checkpoints.latest(tmp_path) is None

    removed = checkpoints.remove_partial(tmp_path)  # what the next attempt does first
    assert checkpoints.latest(tmp_path) == final
    expected = new_state if new_complete else old_state
    assert checkpoints.load(policy, final) == expected
    left = ".step-000003.old-777" if new_complete else ".step-000003.tmp-777"
    assert [p.name for p in removed] == [left]  # the one not put in place
    assert not list(tmp_path.glob(".step-*"))


def test_only_the_newest_checkpoints_are_kept(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = trained(lora(tiny_model_dir), steps=1)
    for step in (1, 2, 3, 4):
        checkpoints.save(policy, state_at(step), tmp_path, keep=2)
    assert [p.name for p in checkpoints.complete_checkpoints(tmp_path)] == [
        "step-000003",
        "step-000004",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]
    # the same step again replaces it, atomically, leaving no temporary folder behind
    checkpoints.save(policy, state_at(4), tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]


def test_past_step_999999_the_newest_checkpoint_is_still_the_latest(tmp_path: Path) -> None:
    """Names were sorted as text: step-1000000 (7 digits) came before step-999998, so the
    newest was taken for the oldest, and pruning deleted the one just written."""
    for step in (999_996, 999_998, 1_000_000):
        folder = tmp_path / checkpoints.step_name(step)
        folder.mkdir()
        (folder / checkpoints.MANIFEST).write_text(json.dumps({"step": step, "files": {}}))
    (tmp_path / "step-notes").mkdir()  # not a checkpoint's name: ignored
    latest = checkpoints.latest(tmp_path)
    assert latest is not None and latest.name == "step-1000000"
    checkpoints.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "step-notes") == [
        "step-1000000",
        "step-999998",
    ]


def test_an_inconsistent_trainer_state_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = trained(lora(tiny_model_dir), steps=1)
    state = state_at(3).model_copy(update={"data_cursor": 5})
    path = checkpoints.save(policy, state, tmp_path, keep=2)
    with pytest.raises(CheckpointError, match="data_cursor 5"):
        checkpoints.load(policy, path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_on_cuda_the_round_trip_restores_the_cuda_generator(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = lora(tiny_model_dir)
    torch.manual_seed(3)
    policy = Policy(spec, learning_rate=1e-2, device="cuda")
    torch.rand(1, device="cuda")  # the CUDA generator is initialized and has moved
    path = checkpoints.save(policy, state_at(1), tmp_path, keep=1)
    expected = torch.rand(4, device="cuda")
    fresh = Policy(spec, learning_rate=1e-2, device="cuda")
    torch.manual_seed(99)
    checkpoints.load(fresh, path)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    for name, want in policy.trainable_state().items():
        assert torch.equal(fresh.trainable_state()[name], want), name


_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.errors import CheckpointError
from opentinker.services.trainer.model.policy import Policy
from opentinker.spec import ModelSpec
folder = Path(sys.argv[2])
policy = Policy(ModelSpec(base_model=sys.argv[1], finetune="full"), learning_rate=1e-2)
state = checkpoints.TrainerState(job_id="job-c", step=1, policy_version=1, data_cursor=1)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    checkpoints.save(policy, state, folder, keep=2)
except CheckpointError as err:
    print("REFUSED", err)
"""


def test_a_checkpoint_the_disk_cannot_hold_leaves_nothing_behind(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A save that runs out of space (a real write failure: a file size limit, as a full disk
    fails a write) raises CheckpointError naming the checkpoint and deletes its half-written
    folder, which used to stay and keep the space taken."""
    import subprocess
    import sys

    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK)
    folder = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED could not write checkpoint" in done.stdout and "step-000001" in done.stdout
    assert list(folder.iterdir()) == []  # no hidden half-written folder
