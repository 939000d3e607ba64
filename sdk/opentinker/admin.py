"""The administrators' client: tenants, users, API keys and worker tokens.

    from opentinker.admin import AdminClient
    with AdminClient("127.0.0.1:50051", api_key=admin_key) as admin:
        admin.create_tenant("vision-lab")
        admin.create_user("ada", tenant_id="vision-lab")
        key = admin.create_api_key("ada", label="laptop")  # shown once: hand it to Ada

Every call needs an admin's API key; others get PermissionDeniedError.
"""

from __future__ import annotations

from collections.abc import Iterator

from opentinker.connection import Connection
from opentinker.scheduler.v1 import identity_pb2 as pb
from opentinker.scheduler.v1 import identity_pb2_grpc


class AdminClient:
    """A connection to the scheduler's AdminService. Close it (or use ``with``) when done."""

    def __init__(self, address: str, *, api_key: str | None = None, timeout: float = 30.0) -> None:
        self._conn = Connection(address, api_key=api_key, timeout=timeout)
        self._stub = identity_pb2_grpc.AdminServiceStub(self._conn.channel)
        self._call = self._conn.call

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def create_tenant(
        self, tenant_id: str, *, display_name: str = "", timeout: float | None = None
    ) -> pb.Tenant:
        request = pb.CreateTenantRequest(tenant_id=tenant_id, display_name=display_name)
        return self._call(self._stub.CreateTenant, request, timeout).tenant

    def create_user(
        self,
        user_id: str,
        *,
        tenant_id: str,
        admin: bool = False,
        display_name: str = "",
        timeout: float | None = None,
    ) -> pb.User:
        request = pb.CreateUserRequest(
            user_id=user_id,
            tenant_id=tenant_id,
            display_name=display_name,
            role=pb.ROLE_ADMIN if admin else pb.ROLE_MEMBER,
        )
        return self._call(self._stub.CreateUser, request, timeout).user

    def create_api_key(self, user_id: str, *, label: str = "", timeout: float | None = None) -> str:
        """A new key of ``user_id``: returned once, stored only as a digest."""
        request = pb.CreateApiKeyRequest(user_id=user_id, label=label)
        return self._call(self._stub.CreateApiKey, request, timeout).api_key

    def create_worker_token(
        self, *, worker_id: str = "", label: str = "", timeout: float | None = None
    ) -> str:
        """A worker agent's token, returned once. It admits one worker: ``worker_id``, or when
        empty the first worker id that registers with it (bound then, for good)."""
        request = pb.CreateWorkerTokenRequest(worker_id=worker_id, label=label)
        return self._call(self._stub.CreateWorkerToken, request, timeout).worker_token

    def set_quota(
        self,
        tenant_id: str,
        *,
        max_devices: int = 0,
        device_seconds_per_period: float = 0.0,
        period_s: float = 0.0,
        max_priority: int = 0,
        timeout: float | None = None,
    ) -> pb.Tenant:
        """Replace the tenant's quota; 0 = no limit (period_s 0 = a day)."""
        quota = pb.TenantQuota(
            max_devices=max_devices,
            device_seconds_per_period=device_seconds_per_period,
            period_s=period_s,
            max_priority=max_priority,
        )
        request = pb.SetTenantQuotaRequest(tenant_id=tenant_id, quota=quota)
        return self._call(self._stub.SetTenantQuota, request, timeout).tenant

    def revoke_api_key(self, key_prefix: str, *, timeout: float | None = None) -> pb.ApiKeyInfo:
        request = pb.RevokeApiKeyRequest(key_prefix=key_prefix)
        return self._call(self._stub.RevokeApiKey, request, timeout).info

    def list_api_keys(
        self, *, tenant_id: str = "", timeout: float | None = None
    ) -> Iterator[pb.ApiKeyInfo]:
        request = pb.ListApiKeysRequest(tenant_id=tenant_id)
        return self._conn.pages(self._stub.ListApiKeys, request, "keys", timeout)

    def list_tenants(self, *, timeout: float | None = None) -> Iterator[pb.Tenant]:
        request = pb.ListTenantsRequest()
        return self._conn.pages(self._stub.ListTenants, request, "tenants", timeout)

    def list_users(self, *, tenant_id: str = "", timeout: float | None = None) -> Iterator[pb.User]:
        request = pb.ListUsersRequest(tenant_id=tenant_id)
        return self._conn.pages(self._stub.ListUsers, request, "users", timeout)
