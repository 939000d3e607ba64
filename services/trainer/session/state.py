"""Named session states (weights + AdamW state + RNG + step) that any later session of the
same tenant, on the same model, can load.

``<checkpoint_root>/<job_id>/states/<name>/`` holds ``session.json`` (owner tenant, model,
step) and one complete checkpoint written by ``checkpoints.save`` (atomic, with a manifest),
which ``checkpoints.load`` restores exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from opentinker.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
    ResourceExhaustedError,
)
from opentinker.services.common.launch import write_atomic
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.errors import CheckpointError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.storage import StorageError, named
from opentinker.spec import ModelSpec

SESSION_FILE = "session.json"
NAME_PATTERN = re.compile(r"^(?!\.+$)[A-Za-z0-9_.\-]{1,64}$")  # not "." or ".."


class SavedSession(BaseModel):
    """What ``session.json`` says about a saved state."""

    model_config = ConfigDict(extra="ignore")

    tenant_id: str
    job_id: str
    model: ModelSpec
    step: int = Field(ge=0)  # optimizer steps taken when it was saved


def save_state(policy: Policy, *, root: Path, name: str, owner: SavedSession) -> Path:
    """Write the state of ``policy`` as ``name`` under ``root`` (the checkpoint root); returns
    its absolute folder, the path LoadState takes. The same name again replaces it."""
    if not NAME_PATTERN.match(name):
        raise InvalidArgumentError(
            f"name: {name!r} must be 1-64 characters of A-Z a-z 0-9 _ . - (not only dots)",
            reason="BAD_NAME",
        )
    folder = (Path(root) / owner.job_id / "states" / name).resolve()
    trainer_state = checkpoints.TrainerState(
        job_id=owner.job_id, step=0, policy_version=owner.step, data_cursor=0
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        checkpoints.save(policy, trainer_state, folder, keep=1)  # atomic; replaces the old one
        write_atomic(folder / SESSION_FILE, owner.model_dump_json(indent=2))  # last: loadable
    except StorageError as err:
        raise _storage_status(err) from err
    except OSError as err:
        fault = named(err, folder, doing=f"could not save state {name!r} in {folder}")
        if fault is None:
            raise
        raise _storage_status(fault) from err
    return folder


def _storage_status(err: StorageError) -> OpenTinkerError:
    """A full disk is RESOURCE_EXHAUSTED, a read-only or forbidden root FAILED_PRECONDITION;
    the message (fault, path, free space) and the machine reason stay."""
    if err.reason == "DISK_FULL":
        return ResourceExhaustedError(err.message, reason=err.reason)
    return FailedPreconditionError(err.message, reason=err.reason)


def load_state(policy: Policy, path: str, *, root: Path, tenant_id: str) -> SavedSession:
    """Restore the state at ``path`` (absolute, or ``<job id>/states/<name>`` relative to the
    checkpoint root) into ``policy`` exactly (weights, AdamW moments, RNG).

    NOT_FOUND unless it is a state under ``root`` saved by ``tenant_id``; FAILED_PRECONDITION
    when it was saved from another model or LoRA config."""
    root = Path(root).resolve()
    folder = (root / path).resolve()  # a relative path (<job id>/states/<name>) is under root
    missing = NotFoundError(f"path: no saved session state of yours at {path!r}")
    if not folder.is_relative_to(root) or not (folder / SESSION_FILE).is_file():
        raise missing
    saved = SavedSession.model_validate_json((folder / SESSION_FILE).read_text())
    if saved.tenant_id != tenant_id:
        raise missing
    if saved.model != policy.spec:
        raise FailedPreconditionError(
            f"state {path!r} was saved from model {saved.model.base_model!r} "
            f"({saved.model.finetune}, {saved.model.lora}); this session trains "
            f"{policy.spec.base_model!r} ({policy.spec.finetune}, {policy.spec.lora})"
        )
    checkpoint = checkpoints.latest(folder)
    if checkpoint is None:
        raise missing
    try:
        checkpoints.load(policy, checkpoint)
    except CheckpointError as err:
        raise FailedPreconditionError(str(err)) from err
    policy.optimizer.zero_grad(set_to_none=True)
    return saved
