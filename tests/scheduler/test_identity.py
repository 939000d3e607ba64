"""Tenants, users and keys: stored hashed, revoked at once, made by admins through the CLI.

Real Redis (the ``redis_url`` fixture), the real scheduler, the real ``opentinker`` command.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from async_guard import run
from identity_helpers import api_key

from opentinker.errors import AlreadyExistsError, AuthenticationError, ConfigError
from opentinker.scheduler.v1 import identity_pb2
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.scheduler.stores import connect_redis
from opentinker.services.scheduler.tenants.bootstrap import ensure_bootstrap_credentials
from opentinker.services.scheduler.tenants.credentials import load_or_create_secret
from opentinker.services.scheduler.tenants.identity import RedisIdentityStore

pytestmark = pytest.mark.integration
SECRET = b"s" * 64


def store_for(url: str) -> tuple[RedisIdentityStore, object]:
    client = connect_redis(url)
    return RedisIdentityStore(client, server_secret=SECRET), client


def all_redis_bytes(url: str) -> bytes:
    """Every key and value in the database, concatenated (strings, hashes, sets, zsets)."""
    r = redis.Redis.from_url(url)
    chunks = []
    for key in r.scan_iter():
        chunks.append(key)
        kind = r.type(key)
        if kind == b"string":
            chunks.append(r.get(key))
        elif kind == b"hash":
            chunks.extend(b"".join(kv) for kv in r.hgetall(key).items())
        elif kind == b"set":
            chunks.extend(r.smembers(key))
        elif kind == b"zset":
            chunks.extend(m for m, _ in r.zrange(key, 0, -1, withscores=True))
    return b"\n".join(chunks)


def test_a_key_is_stored_only_as_a_digest_and_authenticates_its_user(redis_url: str) -> None:
    async def main() -> str:
        store, client = store_for(redis_url)
        await store.create_tenant("acme")
        await store.create_user("alice", "acme")
        key, info = await store.create_api_key("alice", label="laptop")
        assert key.startswith(f"otk_{info.key_prefix}_") and len(key) > 50
        principal = await store.authenticate(key)
        assert (principal.kind, principal.tenant_id, principal.user_id, principal.role) == (
            "user",
            "acme",
            "alice",
            "member",
        )
        listed = [k async for k in _keys(store)]
        assert [(k.key_prefix, k.user_id, k.label) for k in listed] == [
            (info.key_prefix, "alice", "laptop")
        ]
        assert listed[0].last_used_unix_s > 0  # the authentication above counts as a use
        await client.aclose()
        return key

    key = asyncio.run(main())
    stored = all_redis_bytes(redis_url)
    assert key.encode() not in stored
    assert key.split("_", 2)[2].encode() not in stored  # not even the secret part


async def _keys(store: RedisIdentityStore):  # noqa: ANN202 - async iterator
    page = await store.list_api_keys()
    for info in page.items:
        yield info


def test_bad_revoked_and_tampered_keys_are_refused_at_once(redis_url: str) -> None:
    async def main() -> None:
        store, client = store_for(redis_url)
        await store.create_tenant("acme")
        await store.create_user("alice", "acme")
        key, info = await store.create_api_key("alice")
        tampered = key[:-2] + ("zz" if not key.endswith("zz") else "yy")
        for bad in ("", "hello", tampered, "otk_0123456789ab_" + "a" * 43):
            with pytest.raises(AuthenticationError):
                await store.authenticate(bad)
        # The same key under another server secret (a stolen database) does not work either.
        with pytest.raises(AuthenticationError):
            await RedisIdentityStore(client, server_secret=b"x" * 64).authenticate(key)
        await store.authenticate(key)
        revoked = await store.revoke(info.key_prefix)
        assert revoked.revoked
        with pytest.raises(AuthenticationError, match="revoked"):
            await store.authenticate(key)
        # A job token dies with its attempt.
        token = await store.issue_job_token("job-1", 1, tenant_id="acme", user_id="alice")
        assert (await store.authenticate(token)).job_id == "job-1"
        await store.revoke_job_tokens("job-1")
        with pytest.raises(AuthenticationError):
            await store.authenticate(token)
        await client.aclose()

    asyncio.run(main())


def test_ids_are_checked_and_unique(redis_url: str) -> None:
    async def main() -> None:
        store, client = store_for(redis_url)
        await store.create_tenant("acme")
        with pytest.raises(AlreadyExistsError):
            await store.create_tenant("acme")
        with pytest.raises(ConfigError, match="tenant_id"):
            await store.create_tenant("Bad Tenant!")
        with pytest.raises(Exception, match="tenant 'nope' not found"):
            await store.create_user("bob", "nope")
        await store.create_user("alice", "acme", role=identity_pb2.ROLE_ADMIN)
        with pytest.raises(AlreadyExistsError):
            await store.create_user("alice", "acme")
        key, _ = await store.create_api_key("alice")
        assert (await store.authenticate(key)).is_admin
        await client.aclose()

    asyncio.run(main())


def test_bootstrap_writes_owner_only_files_and_keeps_working_ones(
    redis_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        store, client = store_for(redis_url)
        await ensure_bootstrap_credentials(store, tmp_path)
        admin, worker = (tmp_path / "admin.key"), (tmp_path / "worker.token")
        for path in (admin, worker):
            assert path.stat().st_mode & 0o777 == 0o600
        first = admin.read_text(), worker.read_text()
        assert (await store.authenticate(first[0].strip())).is_admin
        assert (await store.authenticate(first[1].strip())).kind == "worker"
        await ensure_bootstrap_credentials(store, tmp_path)  # a restart: same files
        assert (admin.read_text(), worker.read_text()) == first
        await client.flushdb()  # a new, empty Redis: the old keys no longer work
        await ensure_bootstrap_credentials(store, tmp_path)
        assert admin.read_text() != first[0]
        assert (await store.authenticate(admin.read_text().strip())).is_admin
        await client.aclose()

    asyncio.run(main())


def test_bootstrap_can_put_the_worker_token_apart_from_the_admin_key(
    redis_url: str, tmp_path: Path
) -> None:
    """A worker mounts only the token's folder: it (and every job process it starts) cannot
    read the admin key (issue 35: the worker mounted the whole identity volume)."""

    async def main() -> None:
        store, client = store_for(redis_url)
        admin_dir, worker_dir = tmp_path / "identity", tmp_path / "worker-identity"
        admin_dir.mkdir()
        await ensure_bootstrap_credentials(store, admin_dir, worker_dir)
        assert sorted(p.name for p in admin_dir.iterdir()) == ["admin.key"]
        assert sorted(p.name for p in worker_dir.iterdir()) == ["worker.token"]
        token = (worker_dir / "worker.token").read_text().strip()
        assert (await store.authenticate(token)).kind == "worker"
        await ensure_bootstrap_credentials(store, admin_dir, worker_dir)  # a restart: kept
        assert (worker_dir / "worker.token").read_text().strip() == token
        await client.aclose()

    asyncio.run(main())
    secret_file = tmp_path / "auth.secret"
    secret = load_or_create_secret(secret_file)
    assert secret_file.stat().st_mode & 0o777 == 0o600
    assert load_or_create_secret(secret_file) == secret and len(secret) >= 32


def cli(*args: str, key: str, address: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENTINKER_API_KEY": key}
    return subprocess.run(
        [sys.executable, "-m", "opentinker", "--scheduler", address, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_an_admin_makes_a_tenant_user_and_key_with_the_cli_and_revokes_it(
    redis_url: str,
) -> None:
    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            admin = await api_key(running.stores.identity, tenant="system", user="root", admin=True)
            addr = running.address

            def flow() -> None:
                assert (
                    cli("admin", "create-tenant", "vision", key=admin, address=addr).returncode == 0
                )
                made = cli(
                    "admin", "create-user", "ada", "--tenant", "vision", key=admin, address=addr
                )
                assert made.returncode == 0, made.stdout
                out = cli(
                    "admin", "create-key", "ada", "--label", "laptop", key=admin, address=addr
                )
                assert out.returncode == 0, out.stdout
                key = out.stdout.strip().splitlines()[-1]
                assert key.startswith("otk_")
                who = cli("whoami", key=key, address=addr)
                assert who.returncode == 0 and "ada" in who.stdout and "vision" in who.stdout
                quota = ("admin", "set-quota", "vision", "--max-devices", "2")
                assert cli(*quota, key=admin, address=addr).returncode == 0
                usage = cli("usage", key=key, address=addr)
                assert usage.returncode == 0, usage.stdout
                assert "tenant vision" in usage.stdout and "0 of 2" in usage.stdout
                # A member cannot administer.
                denied = cli("admin", "create-tenant", "mine", key=key, address=addr)
                assert denied.returncode == 2 and "PERMISSION_DENIED" in denied.stdout
                listed = cli("admin", "list-keys", "--tenant", "vision", key=admin, address=addr)
                prefix = key.split("_")[1]
                assert prefix in listed.stdout and key.split("_", 2)[2] not in listed.stdout
                assert cli("admin", "revoke-key", prefix, key=admin, address=addr).returncode == 0
                gone = cli("whoami", key=key, address=addr)
                assert gone.returncode == 2 and "UNAUTHENTICATED" in gone.stdout
                assert "revoked" in gone.stdout
                nokey = cli("jobs", key="", address=addr)
                assert nokey.returncode == 2 and "OPENTINKER_API_KEY" in nokey.stdout

            await asyncio.to_thread(flow)

    run(main, timeout_s=120)
