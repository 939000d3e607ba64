"""The first credentials of a fresh deployment, made by the scheduler at start-up.

With ``OPENTINKER_BOOTSTRAP_DIR`` set, the scheduler makes sure that folder holds
``admin.key`` (an API key of user ``admin``, role admin, in tenant ``system``) and
``worker.token`` (a worker token bound to the first worker id that registers with it: a
token admits one worker, worker_admission.py), each mode 0600 and shown nowhere else. A file
whose credential still works is kept; one that does not (a new Redis, a revoked key) is
replaced. `opentinker up` and compose point the worker at ``worker.token`` and the
people at ``admin.key``, so a single node needs no manual step.

``worker.token`` may go to a folder of its own (``OPENTINKER_WORKER_TOKEN_DIR``): compose
mounts that one, read-only, into the worker, and the admin key and the auth secret stay where
no worker (and so no job process it starts) can read them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import structlog

from opentinker.errors import AlreadyExistsError, OpenTinkerError
from opentinker.scheduler.v1 import identity_pb2
from opentinker.services.common.launch import write_atomic
from opentinker.services.scheduler.tenants.identity import RedisIdentityStore

log = structlog.get_logger(__name__)

ADMIN_TENANT = "system"
ADMIN_USER = "admin"
ADMIN_KEY_FILE = "admin.key"
WORKER_TOKEN_FILE = "worker.token"


async def ensure_bootstrap_credentials(
    store: RedisIdentityStore, directory: Path, worker_directory: Path | None = None
) -> None:
    """Make ``directory``/admin.key and ``worker_directory`` (default ``directory``)
    /worker.token hold working credentials."""
    directory = Path(directory)
    token_file = Path(worker_directory or directory) / WORKER_TOKEN_FILE
    if not await _works(store, directory / ADMIN_KEY_FILE, "user"):
        await _ensure(store.create_tenant(ADMIN_TENANT, "OpenTinker administrators"))
        await _ensure(store.create_user(ADMIN_USER, ADMIN_TENANT, role=identity_pb2.ROLE_ADMIN))
        key, info = await store.create_api_key(ADMIN_USER, label="bootstrap")
        write_atomic(directory / ADMIN_KEY_FILE, key + "\n", mode=0o600)
        log.info(
            "bootstrap_admin_key_written",
            path=str(directory / ADMIN_KEY_FILE),
            key_prefix=info.key_prefix,
        )
    if not await _works(store, token_file, "worker"):
        token, info = await store.create_worker_token(label="bootstrap")
        token_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(token_file, token + "\n", mode=0o600)
        log.info(
            "bootstrap_worker_token_written",
            path=str(token_file),
            key_prefix=info.key_prefix,
        )


async def _works(store: RedisIdentityStore, path: Path, kind: str) -> bool:
    if not path.exists():
        return False
    try:
        principal = await store.authenticate(path.read_text().strip())
    except OpenTinkerError:
        return False
    return principal.kind == kind


async def _ensure(creation) -> None:
    with contextlib.suppress(AlreadyExistsError):
        await creation
