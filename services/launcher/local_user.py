"""The API key of the person who runs `opentinker up` / `demo`: made once, kept in a 0600 file.

The scheduler writes an admin key at start-up (bootstrap.py); with it the launcher makes tenant
``local``, a user named after the login, and an API key, through the real AdminService. A key
file whose key still works is reused, so restarting the mesh on the same Redis keeps the key.
"""

from __future__ import annotations

import contextlib
import getpass
import re
import time
from pathlib import Path

from opentinker.admin import AdminClient
from opentinker.client import Client
from opentinker.errors import AlreadyExistsError, AuthenticationError
from opentinker.services.common.launch import wait_for_file, write_atomic

LOCAL_TENANT = "local"


def local_user_id() -> str:
    """The login name as a valid user id (lowercase letters, digits, '.', '_', '-')."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        name = "local"
    name = re.sub(r"[^a-z0-9._-]", "-", name.lower()).strip("-._") or "local"
    return name[:63]


def ensure_local_user_key(
    scheduler_address: str, *, admin_key_file: Path, key_file: Path, timeout_s: float = 30.0
) -> str:
    """A working API key for the local user, from ``key_file`` or made and written there."""
    if key_file.exists():
        key = key_file.read_text().strip()
        with (
            Client(scheduler_address, api_key=key, timeout=timeout_s) as client,
            contextlib.suppress(AuthenticationError),
        ):
            client.whoami()
            return key
    admin_key = wait_for_file(admin_key_file, timeout_s=timeout_s)
    user = local_user_id()
    with AdminClient(scheduler_address, api_key=admin_key, timeout=timeout_s) as admin:
        with contextlib.suppress(AlreadyExistsError):
            admin.create_tenant(LOCAL_TENANT, display_name="this machine")
        with contextlib.suppress(AlreadyExistsError):
            admin.create_user(user, tenant_id=LOCAL_TENANT)
        key = admin.create_api_key(user, label=f"opentinker up {time.strftime('%Y-%m-%d')}")
    write_atomic(key_file, key + "\n", mode=0o600)
    return key
