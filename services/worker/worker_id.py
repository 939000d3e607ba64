"""The worker agent's default identity, stable across restarts of the same agent.

A worker token admits one worker id, and one made for none (the bootstrap ``worker.token``)
is bound to the first id that registers with it (scheduler/tenants/worker_admission.py). The old
default id, ``<hostname>-<pid>``, changed at every start, so a restarted agent would have been
refused by the token its previous run bound. When ``OPENTINKER_WORKER_ID`` is not set, the
agent's id is therefore kept in ``<run_root>/worker.id``: made once as ``<hostname>-<6 random
hex digits>`` and read back at every later start. Two agents on one host get distinct ids as
long as each has its own run root (as their running jobs need anyway); two that share a run
root share the id, and the scheduler refuses the second while the first is connected.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets

from opentinker.errors import ConfigError
from opentinker.services.worker.settings import WorkerSettings

ID_FILE = "worker.id"
_VALID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def with_stable_worker_id(settings: WorkerSettings) -> WorkerSettings:
    """``settings`` as given when they name a worker id; else with the id kept in the run root
    (made there on first use)."""
    if "worker_id" in settings.model_fields_set:
        return settings
    return settings.model_copy(update={"worker_id": stable_worker_id(settings)})


def stable_worker_id(settings: WorkerSettings) -> str:
    path = settings.run_root / ID_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        made = _safe(f"{settings.hostname}-{secrets.token_hex(3)}")
        with contextlib.suppress(FileExistsError):  # another agent made it first: theirs
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(made + "\n")
    worker_id = path.read_text().strip()
    if not _VALID.match(worker_id):
        raise ConfigError(
            f"{path} holds {worker_id!r}, not a worker id (letters, digits, '.', '_', '-'): "
            "delete the file (a new id is made; its worker token must then be bound to it) or "
            "set OPENTINKER_WORKER_ID",
            reason="BAD_WORKER_ID_FILE",
        )
    return worker_id


def _safe(text: str) -> str:
    return (re.sub(r"[^A-Za-z0-9._-]", "-", text).strip("-._") or "worker")[:128]
