"""Credentials for tests, made through the real identity store (Redis) of a running scheduler."""

from __future__ import annotations

import contextlib
import os

import grpc

from opentinker.errors import AlreadyExistsError
from opentinker.scheduler.v1 import identity_pb2
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.scheduler.tenants.identity import IdentityStore


def user_key() -> str:
    """The session's user key of tenant acme ($OPENTINKER_API_KEY, set by ``identities``)."""
    return os.environ["OPENTINKER_API_KEY"]


def user_channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel carrying the session's user key ($OPENTINKER_API_KEY, set by the
    ``identities`` fixture), as a notebook of tenant acme would hold."""
    return aio_channel(address, credential=user_key())


async def api_key(
    identity: IdentityStore, *, tenant: str = "acme", user: str = "alice", admin: bool = False
) -> str:
    """A new API key of ``user`` in ``tenant`` (both made when missing)."""
    with contextlib.suppress(AlreadyExistsError):
        await identity.create_tenant(tenant)
    role = identity_pb2.ROLE_ADMIN if admin else identity_pb2.ROLE_MEMBER
    with contextlib.suppress(AlreadyExistsError):
        await identity.create_user(user, tenant, role=role)
    existing = await identity.get_user(user)
    assert existing.tenant_id == tenant, f"user {user!r} is in tenant {existing.tenant_id!r}"
    key, _ = await identity.create_api_key(user, label="test")
    return key


async def worker_token(identity: IdentityStore, *, worker_id: str = "") -> str:
    token, _ = await identity.create_worker_token(worker_id=worker_id, label="test")
    return token


def other_tenant_key(mesh, tenant: str, user: str) -> str:
    """An API key of ``user`` in a new ``tenant`` of a LocalMesh, made with its admin key."""
    from opentinker.admin import AdminClient  # noqa: PLC0415 - only the mesh tests need it
    from opentinker.services.scheduler.tenants.bootstrap import ADMIN_KEY_FILE  # noqa: PLC0415

    admin_key = (mesh.secrets_dir / ADMIN_KEY_FILE).read_text().strip()
    with AdminClient(mesh.scheduler_address, api_key=admin_key) as admin:
        admin.create_tenant(tenant)
        admin.create_user(user, tenant_id=tenant)
        return admin.create_api_key(user)
