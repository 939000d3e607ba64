"""Tenants, users and credentials in Redis; the scheduler's authenticator.

Redis layout (``prefix`` defaults to ``ot:id``)::

    <prefix>:tenant:<tenant_id>     STRING serialized identity_pb2.Tenant
    <prefix>:tenants                ZSET tenant id -> creation time
    <prefix>:user:<user_id>         STRING serialized identity_pb2.User
    <prefix>:users                  ZSET user id -> creation time
    <prefix>:cred:<key_prefix>      HASH digest, principal (identity_pb2.Principal), info
                                    (identity_pb2.ApiKeyInfo), last_used, revoked, and for a
                                    worker token made with no worker id, bound_worker_id
    <prefix>:creds                  ZSET key prefix -> creation time (API keys, worker tokens)
    <prefix>:job-creds:<job_id>     SET key prefixes of the job's tokens (deleted with them)

A job token is deleted when its attempt ends; a revoked API key is kept (for listings) and
refused at once. Only digests are stored (credentials.py).

A worker token admits exactly one worker identity (issue 37: the bootstrap token, valid for any
worker id, let a rogue holding it register as a new worker and take another job's launch and
job token). One made with a ``worker_id`` is bound to it from the start; one made without (the
bootstrap ``worker.token``, or ``create-worker-token`` with no ``--worker-id``) is bound on first
use: the first ConnectWorker that presents it writes its worker id into ``bound_worker_id``
(HSETNX: of two racing first registrations exactly one wins) and from then on the token is that
worker's, shown so in listings and in the principal it authenticates as. Trust on first use is
what keeps a single node zero-step (the scheduler writes the token before any worker exists);
the worker's default id is kept stable across restarts (worker/worker_id.py) so that the same
machine is still admitted after a restart.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol, cast

import redis.asyncio as aioredis

from opentinker.auth import parse_credential
from opentinker.errors import AlreadyExistsError, AuthenticationError, ConfigError
from opentinker.scheduler.v1 import identity_pb2
from opentinker.services.common.auth import Principal
from opentinker.services.scheduler.errors import IdentityNotFoundError
from opentinker.services.scheduler.redis_text import as_text
from opentinker.services.scheduler.tenants.credentials import digest, matches, mint

TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
USER_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
MIN_PERIOD_S = 60.0  # shorter budget periods would only churn Redis keys
LAST_USED_RESOLUTION_S = 5.0  # last_used is written at most this often per credential
DEFAULT_PAGE_SIZE = 100
_ROLES = {
    identity_pb2.ROLE_UNSPECIFIED: "member",
    identity_pb2.ROLE_MEMBER: "member",
    identity_pb2.ROLE_ADMIN: "admin",
}


@dataclass(frozen=True)
class Page:
    items: list[Any]
    next_page_token: str


class IdentityStore(Protocol):
    async def authenticate(self, credential: str) -> Principal: ...
    async def create_tenant(
        self, tenant_id: str, display_name: str = ""
    ) -> identity_pb2.Tenant: ...
    async def get_tenant(self, tenant_id: str) -> identity_pb2.Tenant: ...
    async def set_quota(
        self, tenant_id: str, quota: identity_pb2.TenantQuota
    ) -> identity_pb2.Tenant: ...
    async def list_tenants(self, *, page_size: int = 0, page_token: str = "") -> Page: ...
    async def create_user(
        self,
        user_id: str,
        tenant_id: str,
        *,
        display_name: str = "",
        role: identity_pb2.Role = identity_pb2.ROLE_UNSPECIFIED,
    ) -> identity_pb2.User: ...
    async def get_user(self, user_id: str) -> identity_pb2.User: ...
    async def list_users(
        self, *, tenant_id: str = "", page_size: int = 0, page_token: str = ""
    ) -> Page: ...
    async def create_api_key(
        self, user_id: str, *, label: str = ""
    ) -> tuple[str, identity_pb2.ApiKeyInfo]: ...
    async def create_worker_token(
        self, *, worker_id: str = "", label: str = ""
    ) -> tuple[str, identity_pb2.ApiKeyInfo]: ...
    async def list_api_keys(
        self, *, tenant_id: str = "", page_size: int = 0, page_token: str = ""
    ) -> Page: ...
    async def revoke(self, key_prefix: str) -> identity_pb2.ApiKeyInfo: ...
    async def is_revoked(self, key_prefix: str) -> bool:
        """True when the credential was revoked or is gone (a job token of an ended attempt);
        for long-lived streams, admitted once, to check again."""

    async def issue_job_token(
        self, job_id: str, attempt: int, *, tenant_id: str, user_id: str
    ) -> str: ...
    async def revoke_job_tokens(self, job_id: str) -> None: ...
    async def bind_worker_token(self, key_prefix: str, worker_id: str) -> str:
        """Bind the worker token ``key_prefix``, made with no worker id, to ``worker_id``
        unless it is bound already; the worker id it is bound to now (atomic: of two first
        uses, one wins and the other gets the winner's id)."""


class RedisIdentityStore:
    """IdentityStore on one Redis; ``server_secret`` keys the HMAC of every credential."""

    def __init__(
        self, client: aioredis.Redis, *, server_secret: bytes, prefix: str = "ot:id"
    ) -> None:
        self._r = client
        self._secret = server_secret
        self._prefix = prefix

    def _key(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    # ---- authentication ---------------------------------------------------------------------

    async def authenticate(self, credential: str) -> Principal:
        parsed = parse_credential(credential)
        if parsed is None:
            raise AuthenticationError(
                "the credential is malformed: expected an OpenTinker key like otk_<prefix>_<secret>"
            )
        prefix = parsed[1]
        key = self._key("cred", prefix)
        stored, principal, revoked, last_used, bound = await self._r.hmget(
            key, "digest", "principal", "revoked", "last_used", "bound_worker_id"
        )
        if stored is None or not matches(self._secret, credential, as_text(stored)):
            raise AuthenticationError(f"unknown credential (key {prefix}); ask an admin for a key")
        if revoked == b"1":
            raise AuthenticationError(f"the key {prefix} was revoked; ask an admin for a new one")
        now = time.time()
        if last_used is None or now - float(last_used) > LAST_USED_RESOLUTION_S:
            await self._r.hset(key, "last_used", repr(now))
        pb = identity_pb2.Principal.FromString(principal)
        if bound is not None and not pb.worker_id:
            pb.worker_id = as_text(bound)  # a worker token bound on first use
        return Principal.from_proto(pb)

    # ---- tenants and users ------------------------------------------------------------------

    async def create_tenant(self, tenant_id: str, display_name: str = "") -> identity_pb2.Tenant:
        if not TENANT_ID.match(tenant_id):
            raise ConfigError(
                f"tenant_id {tenant_id!r}: use 1-63 lowercase letters, digits or '-'",
                reason="INVALID_TENANT_ID",
            )
        tenant = identity_pb2.Tenant(
            tenant_id=tenant_id, display_name=display_name or tenant_id, created_unix_s=time.time()
        )
        if not await self._r.set(
            self._key("tenant", tenant_id), tenant.SerializeToString(), nx=True
        ):
            raise AlreadyExistsError(f"tenant {tenant_id!r} exists already", reason="TENANT_EXISTS")
        await self._r.zadd(self._key("tenants"), {tenant_id: tenant.created_unix_s})
        return tenant

    async def get_tenant(self, tenant_id: str) -> identity_pb2.Tenant:
        raw = await self._r.get(self._key("tenant", tenant_id))
        if raw is None:
            raise IdentityNotFoundError(f"tenant {tenant_id!r} not found", reason="NO_TENANT")
        return identity_pb2.Tenant.FromString(raw)

    async def set_quota(
        self, tenant_id: str, quota: identity_pb2.TenantQuota
    ) -> identity_pb2.Tenant:
        """Replace the tenant's quota (limits of 0 = none); ConfigError naming every bad field."""
        problems = [
            f"quota.{name}: {getattr(quota, name)} must be a number >= 0 (0 = no limit)"
            for name in ("max_devices", "device_seconds_per_period", "period_s", "max_priority")
            if not (math.isfinite(getattr(quota, name)) and getattr(quota, name) >= 0)
        ]
        if 0 < quota.period_s < MIN_PERIOD_S:
            problems.append(
                f"quota.period_s: {quota.period_s:g} s is shorter than {MIN_PERIOD_S:g} s "
                "(0 = a day)"
            )
        if problems:
            raise ConfigError("; ".join(problems), reason="BAD_QUOTA")
        tenant = await self.get_tenant(tenant_id)
        tenant.quota.CopyFrom(quota)
        await self._r.set(self._key("tenant", tenant_id), tenant.SerializeToString())
        return tenant

    async def list_tenants(self, *, page_size: int = 0, page_token: str = "") -> Page:
        return await self._page("tenants", "tenant", identity_pb2.Tenant, page_size, page_token)

    async def create_user(
        self,
        user_id: str,
        tenant_id: str,
        *,
        display_name: str = "",
        role: identity_pb2.Role = identity_pb2.ROLE_UNSPECIFIED,
    ) -> identity_pb2.User:
        if not USER_ID.match(user_id):
            raise ConfigError(
                f"user_id {user_id!r}: use 1-63 lowercase letters, digits, '.', '_' or '-'",
                reason="INVALID_USER_ID",
            )
        await self.get_tenant(tenant_id)
        user = identity_pb2.User(
            user_id=user_id,
            tenant_id=tenant_id,
            display_name=display_name or user_id,
            role=role or identity_pb2.ROLE_MEMBER,
            created_unix_s=time.time(),
        )
        if not await self._r.set(self._key("user", user_id), user.SerializeToString(), nx=True):
            raise AlreadyExistsError(f"user {user_id!r} exists already", reason="USER_EXISTS")
        await self._r.zadd(self._key("users"), {user_id: user.created_unix_s})
        return user

    async def get_user(self, user_id: str) -> identity_pb2.User:
        raw = await self._r.get(self._key("user", user_id))
        if raw is None:
            raise IdentityNotFoundError(f"user {user_id!r} not found", reason="NO_USER")
        return identity_pb2.User.FromString(raw)

    async def list_users(
        self, *, tenant_id: str = "", page_size: int = 0, page_token: str = ""
    ) -> Page:
        page = await self._page("users", "user", identity_pb2.User, page_size, page_token)
        return Page(
            [u for u in page.items if not tenant_id or u.tenant_id == tenant_id],
            page.next_page_token,
        )

    # ---- credentials --------------------------------------------------------------------------

    async def create_api_key(
        self, user_id: str, *, label: str = ""
    ) -> tuple[str, identity_pb2.ApiKeyInfo]:
        user = await self.get_user(user_id)
        principal = Principal(
            kind="user",
            key_prefix="",
            tenant_id=user.tenant_id,
            user_id=user.user_id,
            role=_ROLES[user.role],
        )
        return await self._store("user", principal, label=label, listed=True)

    async def create_worker_token(
        self, *, worker_id: str = "", label: str = ""
    ) -> tuple[str, identity_pb2.ApiKeyInfo]:
        principal = Principal(kind="worker", key_prefix="", worker_id=worker_id)
        return await self._store("worker", principal, label=label, listed=True)

    async def issue_job_token(
        self, job_id: str, attempt: int, *, tenant_id: str, user_id: str
    ) -> str:
        principal = Principal(
            kind="job",
            key_prefix="",
            tenant_id=tenant_id,
            user_id=user_id,
            job_id=job_id,
            attempt=attempt,
        )
        credential, info = await self._store("job", principal, label=f"{job_id}#{attempt}")
        await self._r.sadd(self._key("job-creds", job_id), info.key_prefix)
        return credential

    async def revoke_job_tokens(self, job_id: str) -> None:
        set_key = self._key("job-creds", job_id)
        prefixes = await self._r.smembers(set_key)
        if prefixes:
            await self._r.delete(*(self._key("cred", as_text(p)) for p in prefixes))
        await self._r.delete(set_key)

    async def bind_worker_token(self, key_prefix: str, worker_id: str) -> str:
        key = self._key("cred", key_prefix)
        if not worker_id:
            raise ConfigError("worker_id: set it", reason="INVALID_WORKER_ID")
        # HSETNX on the credential's own hash: atomic, and gone with the credential. A hash
        # deleted meanwhile (a job token, never bound) must not be re-created with one field.
        if not await self._r.exists(key):
            raise IdentityNotFoundError(f"no key with prefix {key_prefix!r}", reason="NO_KEY")
        await self._r.hsetnx(key, "bound_worker_id", worker_id)
        bound = await self._r.hget(key, "bound_worker_id")
        return as_text(bound) if bound is not None else worker_id

    async def list_api_keys(
        self, *, tenant_id: str = "", page_size: int = 0, page_token: str = ""
    ) -> Page:
        start, size = _page_bounds(page_size, page_token)
        prefixes = await self._members(self._key("creds"), start, start + size)
        infos = []
        for prefix in prefixes[:size]:
            info = await self._info(prefix)
            if info is not None and (not tenant_id or info.tenant_id == tenant_id):
                infos.append(info)
        return Page(infos, str(start + size) if len(prefixes) > size else "")

    async def revoke(self, key_prefix: str) -> identity_pb2.ApiKeyInfo:
        info = await self._info(key_prefix)
        if info is None or info.kind == identity_pb2.PRINCIPAL_KIND_JOB:
            raise IdentityNotFoundError(f"no key with prefix {key_prefix!r}", reason="NO_KEY")
        await self._r.hset(self._key("cred", key_prefix), "revoked", "1")
        info.revoked = True
        return info

    async def is_revoked(self, key_prefix: str) -> bool:
        digest_, revoked = await self._r.hmget(self._key("cred", key_prefix), "digest", "revoked")
        return digest_ is None or revoked == b"1"

    async def _store(
        self, kind: str, principal: Principal, *, label: str, listed: bool = False
    ) -> tuple[str, identity_pb2.ApiKeyInfo]:
        credential, prefix = mint(kind)
        pb = principal.to_proto()
        pb.key_prefix = prefix
        now = time.time()
        info = identity_pb2.ApiKeyInfo(
            key_prefix=prefix,
            kind=pb.kind,
            tenant_id=pb.tenant_id,
            user_id=pb.user_id,
            label=label,
            created_unix_s=now,
            worker_id=pb.worker_id,
        )
        await self._r.hset(
            self._key("cred", prefix),
            mapping={
                "digest": digest(self._secret, credential),
                "principal": pb.SerializeToString(),
                "info": info.SerializeToString(),
                "revoked": "0",
            },
        )
        if listed:
            await self._r.zadd(self._key("creds"), {prefix: now})
        return credential, info

    async def _info(self, key_prefix: str) -> identity_pb2.ApiKeyInfo | None:
        raw, revoked, last_used, bound = await self._r.hmget(
            self._key("cred", key_prefix), "info", "revoked", "last_used", "bound_worker_id"
        )
        if raw is None:
            return None
        info = identity_pb2.ApiKeyInfo.FromString(raw)
        if bound is not None and not info.worker_id:
            info.worker_id = as_text(bound)
        info.revoked = revoked == b"1"
        info.last_used_unix_s = float(last_used) if last_used else 0.0
        return info

    async def _members(self, key: str, start: int, end: int) -> list[str]:
        """The members ranked start..end (inclusive) of the sorted set ``key``."""
        # redis-py types zrange's members as its WITHSCORES pairs too; without, they are bytes.
        members = cast("list[bytes]", await self._r.zrange(key, start, end))
        return [as_text(m) for m in members]

    async def _page(self, index: str, kind: str, message: Any, page_size: int, token: str) -> Page:
        start, size = _page_bounds(page_size, token)
        ids = await self._members(self._key(index), start, start + size)
        raws = await self._r.mget([self._key(kind, i) for i in ids[:size]]) if ids else []
        items = [message.FromString(raw) for raw in raws if raw is not None]
        return Page(items, str(start + size) if len(ids) > size else "")


def _page_bounds(page_size: int, page_token: str) -> tuple[int, int]:
    if page_size < 0 or (page_token and not page_token.isdigit()):
        raise ConfigError(
            "page_size must be >= 0 and page_token one this server issued", reason="INVALID_PAGE"
        )
    return int(page_token or 0), min(page_size or DEFAULT_PAGE_SIZE, 1000)
