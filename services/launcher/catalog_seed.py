"""A fresh single-node mesh lists the model it runs: ``opentinker up`` and ``opentinker demo``
register the tiny local model in the scheduler's catalog (with the mesh's admin key), so
``opentinker models list`` answers from the start, and jobs naming ``tiny-qwen2`` run on it.
Registering makes the catalog non-empty: from then on a job must name a model of it (an admin
adds more with ``opentinker models register NAME --location DIR``)."""

from __future__ import annotations

from pathlib import Path

from opentinker.catalog import ModelInfo, describe_folder
from opentinker.client import Client
from opentinker.services.scheduler.tenants.bootstrap import ADMIN_KEY_FILE

TINY_MODEL_NAME = "tiny-qwen2"


def register_local_model(
    scheduler_address: str, secrets_dir: Path, model_dir: Path, *, name: str, description: str
) -> ModelInfo:
    """Add ``model_dir`` (a folder on this machine, the mesh's worker) to the catalog as
    ``name``, with the admin key the scheduler wrote into ``secrets_dir``."""
    admin_key = (secrets_dir / ADMIN_KEY_FILE).read_text().strip()
    model = ModelInfo(
        name=name,
        location=str(Path(model_dir).resolve()),
        description=description,
        **describe_folder(model_dir),
    )
    with Client(scheduler_address, api_key=admin_key) as admin:
        return admin.register_model(model)
