"""``opentinker admin ...``: tenants, users, API keys and worker tokens (an admin's key)."""

from __future__ import annotations

import argparse
import datetime as dt
import os

from rich.console import Console
from rich.table import Column, Table

from opentinker.admin import AdminClient
from opentinker.client import DEFAULT_ADDRESS
from opentinker.scheduler.v1 import identity_pb2

console = Console()


def _admin(args: argparse.Namespace) -> AdminClient:
    address = args.scheduler or os.environ.get("OPENTINKER_SCHEDULER_ADDRESS", DEFAULT_ADDRESS)
    return AdminClient(address, api_key=args.api_key)


def _when(unix_s: float) -> str:
    return dt.datetime.fromtimestamp(unix_s).strftime("%Y-%m-%d %H:%M") if unix_s else "never"


def cmd_create_tenant(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        tenant = admin.create_tenant(args.tenant_id, display_name=args.name)
    console.print(f"tenant [bold]{tenant.tenant_id}[/] created")
    return 0


def cmd_create_user(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        user = admin.create_user(args.user_id, tenant_id=args.tenant, admin=args.admin)
    role = "admin" if user.role == identity_pb2.ROLE_ADMIN else "member"
    console.print(f"user [bold]{user.user_id}[/] ({role}) created in tenant {user.tenant_id}")
    return 0


def cmd_create_key(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        key = admin.create_api_key(args.user_id, label=args.label)
    console.print(f"API key of {args.user_id} (shown once, store it now):")
    print(key)  # plain, so that it can be piped into a file
    return 0


def cmd_create_worker_token(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        token = admin.create_worker_token(worker_id=args.worker_id, label=args.label)
    whom = args.worker_id or "the first worker id that registers with it"
    console.print(f"worker token for {whom} (a token admits one worker; shown once):")
    print(token)
    return 0


def cmd_list_keys(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        keys = list(admin.list_api_keys(tenant_id=args.tenant))
    table = Table("kind", "owner", "tenant", "label", "created", "last used", "state")
    table.columns.insert(0, Column("prefix", no_wrap=True, min_width=12))
    for k in keys:
        kind = identity_pb2.PrincipalKind.Name(k.kind).removeprefix("PRINCIPAL_KIND_").lower()
        table.add_row(
            k.key_prefix,
            kind,
            k.user_id or k.worker_id or "*",
            k.tenant_id,
            k.label,
            _when(k.created_unix_s),
            _when(k.last_used_unix_s),
            "[red]revoked[/]" if k.revoked else "active",
        )
    console.print(table)
    return 0


def cmd_set_quota(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        tenant = admin.set_quota(
            args.tenant_id,
            max_devices=args.max_devices,
            device_seconds_per_period=args.device_seconds,
            period_s=args.period_s,
            max_priority=args.max_priority,
        )
    q = tenant.quota
    console.print(
        f"tenant {tenant.tenant_id}: at most {q.max_devices or 'any'} devices, "
        f"{q.device_seconds_per_period or 'unlimited'} device-seconds per "
        f"{q.period_s or 86400:g} s, priority up to {q.max_priority or 'any'}"
    )
    return 0


def cmd_revoke_key(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        info = admin.revoke_api_key(args.key_prefix)
    console.print(f"key {info.key_prefix} of {info.user_id or info.worker_id} revoked")
    return 0


def add_admin_commands(sub: argparse._SubParsersAction) -> None:
    admin = sub.add_parser("admin", help="tenants, users and keys (needs an admin's API key)")
    commands = admin.add_subparsers(dest="admin_command", required=True)

    p = commands.add_parser("create-tenant", help="make a tenant (a team)")
    p.add_argument("tenant_id")
    p.add_argument("--name", default="", help="display name")
    p.set_defaults(func=cmd_create_tenant)

    p = commands.add_parser("create-user", help="make a user in a tenant")
    p.add_argument("user_id")
    p.add_argument("--tenant", required=True)
    p.add_argument("--admin", action="store_true", help="may administer every tenant")
    p.set_defaults(func=cmd_create_user)

    p = commands.add_parser("create-key", help="make an API key for a user (printed once)")
    p.add_argument("user_id")
    p.add_argument("--label", default="")
    p.set_defaults(func=cmd_create_key)

    p = commands.add_parser("create-worker-token", help="make a worker agent's token")
    p.add_argument(
        "--worker-id",
        default="",
        help="the worker id it admits (default: the first that registers with it; a token "
        "admits one worker)",
    )
    p.add_argument("--label", default="")
    p.set_defaults(func=cmd_create_worker_token)

    p = commands.add_parser("list-keys", help="keys and worker tokens: prefix, owner, last use")
    p.add_argument("--tenant", default="", help="only this tenant's")
    p.set_defaults(func=cmd_list_keys)

    p = commands.add_parser("set-quota", help="limits of a tenant (0 = no limit)")
    p.add_argument("tenant_id")
    p.add_argument("--max-devices", type=int, default=0, help="devices held at once")
    p.add_argument("--device-seconds", type=float, default=0.0, help="budget per period")
    p.add_argument("--period-s", type=float, default=0.0, help="budget period (default a day)")
    p.add_argument("--max-priority", type=int, default=0, help="highest job priority allowed")
    p.set_defaults(func=cmd_set_quota)

    p = commands.add_parser("revoke-key", help="revoke a key at once, by its prefix")
    p.add_argument("key_prefix")
    p.set_defaults(func=cmd_revoke_key)
