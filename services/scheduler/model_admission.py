"""Which model a submitted job may name, decided from the catalog (``model_catalog.py``).

While the catalog is empty every ``model.base_model`` is accepted as it is (a pool nobody has
described; the workers find out). Once it holds a model, a job must name one of them, by its
name or by where it lives on the workers, and is refused at submit otherwise, with the names it
has; before, such a job failed later, on the worker. A path naming one of the caller's jobs (a
checkpoint: ``<root>/<job-id>/step-…``) is accepted too: that job's model was admitted when it
was submitted, and ``spec_paths.py`` has checked the job is the caller's tenant's.

A job naming a model by name runs on the entry's location, and with the entry's chat template
when its spec chooses none; a training job (RL, SFT, session) must ask for a finetune the
entry allows.
"""

from __future__ import annotations

import os

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.scheduler.v1 import models_pb2
from opentinker.services.common.spec_paths import named_job_ids
from opentinker.services.scheduler.model_catalog import model_names

_TRAINING_KINDS = (common_pb2.JOB_KIND_RL, common_pb2.JOB_KIND_SFT, common_pb2.JOB_KIND_SESSION)
_FINETUNE_NAMES = {common_pb2.FINETUNE_MODE_LORA: "lora", common_pb2.FINETUNE_MODE_FULL: "full"}


def find_model(base_model: str, models: list[models_pb2.Model]) -> models_pb2.Model | None:
    """The entry ``base_model`` names: by name first, then by location."""
    for entry in models:
        if entry.name == base_model:
            return entry
    for entry in models:
        if entry.location and _same_place(entry.location, base_model):
            return entry
    return None


def admit_model(spec: common_pb2.JobSpec, models: list[models_pb2.Model]) -> common_pb2.JobSpec:
    """The spec as it will run (its model resolved to the entry's location), or ConfigError
    (INVALID_ARGUMENT) naming the field and the models the pool has."""
    base = spec.model.base_model
    if not models or named_job_ids(base):
        return spec
    entry = find_model(base, models)
    if entry is None:
        raise ConfigError(
            f"model.base_model: {base!r} is not a model of this pool; it has: "
            f"{model_names(models)} (`opentinker models list`; an admin adds one with "
            "`opentinker models register`)",
            reason="MODEL_NOT_IN_CATALOG",
        )
    mode = spec.model.finetune or common_pb2.FINETUNE_MODE_LORA  # unset = the SDK's default
    if spec.kind in _TRAINING_KINDS and entry.finetunes and mode not in entry.finetunes:
        allowed = ", ".join(_FINETUNE_NAMES[m] for m in entry.finetunes)
        raise ConfigError(
            f"model.finetune: {_FINETUNE_NAMES.get(mode, str(mode))!r} is not run on "
            f"{entry.name!r} by this pool; it runs: {allowed}",
            reason="FINETUNE_NOT_ALLOWED",
        )
    resolved = common_pb2.JobSpec()
    resolved.CopyFrom(spec)
    if entry.location:
        resolved.model.base_model = entry.location
    if entry.chat_template and not spec.model.chat_template:
        resolved.model.chat_template = entry.chat_template
    return resolved


def _same_place(a: str, b: str) -> bool:
    return a == b or os.path.normpath(a) == os.path.normpath(b)
