"""Checkpoints that a later attempt of the same job resumes from.

A job's checkpoint folder is ``<checkpoint_root>/<job_id>``, the same for every attempt (the
worker passes it in ``LaunchConfig.checkpoint_dir``). Inside it::

    step-000004/                   the state after step 4
        adapter_config.json, adapter_model.safetensors    LoRA: PeftModel.from_pretrained
        config.json, model.safetensors                    full: AutoModelForCausalLM.from_pretrained
        tokenizer files
        optimizer.pt                AdamW ``state_dict()`` (torch.save)
        critic.pt                   PPO only: the value head and its AdamW (Critic.state_dict)
        rng.pt                      torch CPU (and CUDA) generator states, python ``random`` state
        trainer_state.json          TrainerState
        manifest.json               written last: every other file and its size in bytes
    .step-000006.tmp-<pid>/        being written (or left by a killed attempt): never loaded
    .step-000002.del-<pid>/        being deleted by prune (or left by a killed attempt)

Writing is atomic: the files go to a hidden sibling folder, each is fsync'd, the manifest is
written last, and one rename publishes the folder (then the parent folder is fsync'd). A folder
without a manifest, or whose files do not match it, is never loaded. The last ``keep`` complete
checkpoints are kept; older ones are renamed to hidden names, then deleted, after each save, so
a kill mid-delete never leaves a ``step-N`` folder that looks published. Before a job trains,
``prepare`` checks that the folder can be written (storage.py names a full disk, a read-only
file system, a permission denied, with the path and the free space) and deletes what killed
attempts left half-made: hidden folders, and ``step-N`` folders that can never load.

How often: ``RlConfig.checkpoint_every`` or ``SftConfig.checkpoint_every`` (0 = only the final
checkpoint). It stays 0 by default:
a full fine-tune's checkpoint is the weights plus twice their size in AdamW state, which would
dominate short jobs if written every few steps; a job that wants to survive faults cheaply sets
it (a re-attempt of a job without intermediate checkpoints starts again from step 0, so no
result is wrong, only time is lost).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import structlog
import torch
from pydantic import BaseModel, ConfigDict, Field

from opentinker.services.trainer import storage
from opentinker.services.trainer.errors import CheckpointError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.critic import Critic

if TYPE_CHECKING:
    from opentinker.services.trainer.parallel.ranks import LeaderPolicy

log = structlog.get_logger()

MANIFEST = "manifest.json"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
CRITIC = "critic.pt"
TRAINER_STATE = "trainer_state.json"
_PREFIX = "step-"


class TrainerState(BaseModel):
    """Where the loop stands after ``step`` steps (written as trainer_state.json)."""

    model_config = ConfigDict(extra="ignore")

    job_id: str
    kind: Literal["rl", "sft"] = "rl"  # which loop wrote it
    step: int = Field(ge=0)  # steps done
    policy_version: int = Field(ge=0)  # version of the saved weights
    # Mean episode reward of each step done, step 1 first (len == step): the reward window of
    # stop_at_reward and the first/last-10 final metrics need all of it.
    rewards: list[float] = []
    # Next rollout batch_index. The rollout derives every env seed and sampling seed from
    # (job seed, batch_index) alone, so this is the whole data position; the loop collects
    # batch_index = step, and load() checks that the two agree. (Not the policy a batch ahead
    # was played by: with max_staleness >= 1 a resumed job's next batch is played by the
    # resumed version, one fresher than uninterrupted.) SFT: the index of the next
    # batch in the seeded sequence of batches (also = step).
    data_cursor: int = Field(ge=0)
    # Figures a resumed loop needs beyond these (SFT: the validation loss before training).
    extra: dict[str, float] = {}


def step_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def save(
    policy: Policy | LeaderPolicy,
    state: TrainerState,
    folder: Path,
    *,
    keep: int,
    critic: Critic | None = None,
    rng: dict[str, object] | None = None,
) -> Path:
    """Write a complete checkpoint of ``policy`` (and ``critic``) at ``state.step`` into
    ``folder`` atomically, then delete all but the last ``keep`` complete ones; returns its
    absolute path. A complete checkpoint of the same step is replaced. ``rng``: the generator
    states as the step left them (``rng_state()`` taken then); None = as they are now.
    CheckpointError when it cannot be written, a StorageError (storage.py) when the disk is
    full, read-only or forbidden: what was written is deleted, the last good one stays."""
    folder = Path(folder).resolve()
    final = folder / step_name(state.step)
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        settle_replacements(folder)
        shutil.rmtree(tmp, ignore_errors=True)
        _write(policy, state, tmp, critic=critic, rng=rng)
    except Exception as err:  # a full disk: OSError, or safetensors' / torch's own errors
        fault = _named(err, folder, f"could not write checkpoint {final}")  # free space now
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; it was never loadable
        raise fault from err
    try:
        if final.exists():  # same step again (e.g. the final save after resuming at the end)
            old = folder / f".{final.name}.old-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync(folder)
    except OSError as err:  # e.g. turned read-only meanwhile: the last good one stays
        raise _named(err, folder, f"could not publish checkpoint {final}") from err
    try:
        prune(folder, keep=keep)
    except OSError as err:
        raise _named(err, folder, f"could not delete old checkpoints in {folder}") from err
    return final


def _named(err: BaseException, folder: Path, doing: str) -> CheckpointError:
    """``err`` as a StorageError naming a disk full / read-only / permission denied, else as
    a CheckpointError saying what failed."""
    return storage.named(err, folder, doing=doing) or CheckpointError(
        f"{doing}: {type(err).__name__}: {err}"
    )


def _write(
    policy: Policy | LeaderPolicy,
    state: TrainerState,
    tmp: Path,
    *,
    critic: Critic | None,
    rng: dict[str, object] | None,
) -> None:
    """Every file of the checkpoint into ``tmp``, each fsync'd, the manifest last."""
    policy.save_checkpoint(tmp, trainer_state=state.model_dump())
    torch.save(policy.optimizer.state_dict(), tmp / OPTIMIZER)
    torch.save(rng if rng is not None else rng_state(), tmp / RNG)
    if critic is not None:
        torch.save(critic.state_dict(), tmp / CRITIC)
    # Every file, also in sub-folders (one adapter per role: peft saves each in <role>/).
    files = {
        str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
    }
    for name in files:
        _fsync(tmp / name)
    (tmp / MANIFEST).write_text(json.dumps({"step": state.step, "files": files}, indent=2))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)


def complete_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints in ``folder``, oldest step first (none when it is missing)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and _step_of(p.name) is not None]
    # By step number, not name: past step 999,999 the name has 7 digits and sorted first,
    # so the newest checkpoint was taken for the oldest (and pruned).
    return sorted((p for p in found if is_complete(p)), key=lambda p: _step_of(p.name) or 0)


def _step_of(name: str) -> int | None:
    """The step of a checkpoint folder's name (``step-000012``), or None for another name."""
    digits = name.removeprefix(_PREFIX)
    return int(digits) if name.startswith(_PREFIX) and digits.isdigit() else None


def latest(folder: Path) -> Path | None:
    """The last complete checkpoint in ``folder``, or None."""
    done = complete_checkpoints(folder)
    return done[-1] if done else None


def is_complete(path: Path) -> bool:
    """True when the manifest exists and every file it lists is there with its size."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        return all((path / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def load(policy: Policy, path: Path, *, critic: Critic | None = None) -> TrainerState:
    """Restore weights, AdamW state and RNG state from a complete checkpoint into ``policy``
    (built from the same model spec), and the value head into ``critic`` when given; returns
    the saved TrainerState. Raises CheckpointError."""
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no valid {MANIFEST})")
    try:
        state = TrainerState.model_validate_json((path / TRAINER_STATE).read_text())
        policy.load_weights(path)
        optimizer = torch.load(path / OPTIMIZER, map_location=policy.device, weights_only=True)
        policy.optimizer.load_state_dict(optimizer)
        _set_rng_state(torch.load(path / RNG, weights_only=True))
        if critic is not None:
            critic.load_state_dict(
                torch.load(path / CRITIC, map_location=policy.device, weights_only=True)
            )
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise CheckpointError(
            f"could not resume from checkpoint {path}: {type(err).__name__}: {err}; "
            f"delete that folder to resume from an older checkpoint"
        ) from err
    rewards_missing = state.kind == "rl" and len(state.rewards) != state.step
    if state.data_cursor != state.step or rewards_missing:
        raise CheckpointError(
            f"checkpoint {path} is inconsistent: step {state.step}, data_cursor "
            f"{state.data_cursor}, {len(state.rewards)} step rewards"
        )
    return state


def prune(folder: Path, *, keep: int) -> None:
    """Delete all but the last ``keep`` complete checkpoints in ``folder``. Each is first
    renamed to a hidden name (``.step-N.del-PID``, atomic), then deleted: a kill in between
    leaves a hidden folder for ``remove_partial``, never a half-deleted ``step-N``."""
    doomed = complete_checkpoints(folder)[:-keep] if keep > 0 else []
    moved = []
    for old in doomed:
        aside = old.parent / f".{old.name}.del-{os.getpid()}"
        old.rename(aside)
        moved.append((old, aside))
    if moved:
        _fsync(Path(folder))  # the renames are on disk before any file is deleted
    for old, aside in moved:
        shutil.rmtree(aside, ignore_errors=True)
        log.info("checkpoint_deleted", path=str(old))


def settle_replacements(folder: Path) -> list[Path]:
    """Finish what a save killed between its two renames left: replacing a checkpoint of the
    same step, it had moved the old one aside (``.step-N.old-PID``) and not yet moved the new
    one (``.step-N.tmp-PID``) in, so ``step-N`` is missing. The new one goes in when complete,
    else the old one goes back. Returns the checkpoints put in place."""
    settled = []
    for old in sorted(Path(folder).glob(f".{_PREFIX}*.old-*")):
        name, pid = old.name[1:].rsplit(".old-", 1)
        final = old.parent / name
        if final.exists():
            continue
        for candidate in (old.parent / f".{name}.tmp-{pid}", old):
            if candidate.is_dir() and is_complete(candidate):
                candidate.rename(final)
                log.warning("checkpoint_settled", path=str(final), was=candidate.name)
                settled.append(final)
                break
    return settled


def remove_partial(folder: Path) -> list[Path]:
    """Delete what killed attempts left half-made in ``folder``, once an interrupted
    replacement is settled: hidden folders (half-written ``.step-N.tmp-PID``, half-deleted
    ``.step-N.del-PID``) and ``step-N`` folders that can never load (no manifest, or a file it
    lists gone: a prune killed mid-way by an older version). Call only while no other attempt
    of the job runs. Returns what was deleted."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    settle_replacements(folder)
    partial = [
        p
        for p in sorted(folder.iterdir())
        if p.is_dir() and (p.name.startswith(f".{_PREFIX}") or _half_made(p))
    ]
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


def _half_made(path: Path) -> bool:
    """A ``step-N`` folder that is certainly garbage: its manifest is missing or unreadable
    as JSON, or a file it lists is missing or of another size. A folder that cannot be read
    (EACCES, EIO) is left alone: it may be whole."""
    if _step_of(path.name) is None:
        return False
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        return not all(
            (path / name).is_file() and (path / name).stat().st_size == size
            for name, size in files.items()
        )
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return True
    except OSError:
        return False


def prepare(folder: Path, *, need_bytes: int = 0) -> list[Path]:
    """Before a job trains: check that ``folder`` can take a checkpoint (writable, with
    ``need_bytes`` free; StorageError naming the fault and the path otherwise), then remove
    what earlier attempts left half-made there; returns what was removed."""
    storage.check_writable(folder, need_bytes=need_bytes)
    return remove_partial(folder)


def size_lower_bound(policy: Policy | LeaderPolicy) -> int:
    """Bytes a checkpoint of ``policy`` takes at least: its trainable weights and AdamW's two
    moments of each, in the policy's dtype (files, tokenizer and RNG state come on top)."""
    itemsize = torch.empty((), dtype=policy.dtype).element_size()
    return 3 * policy.num_trainable_parameters() * itemsize


def rng_state() -> dict[str, object]:
    """Every generator the trainer draws from (dropout: torch; nothing uses numpy)."""
    state: dict[str, object] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, object]) -> None:
    torch.set_rng_state(state["torch"])  # type: ignore[arg-type]
    random.setstate(state["python"])  # type: ignore[arg-type]
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])  # type: ignore[arg-type]


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
