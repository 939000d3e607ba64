"""AdminService and IdentityService over gRPC: protobuf <-> IdentityStore, errors -> codes."""

from __future__ import annotations

import grpc
import structlog

from opentinker.errors import OpenTinkerError
from opentinker.scheduler.v1 import identity_pb2 as pb
from opentinker.scheduler.v1 import identity_pb2_grpc
from opentinker.services.common.auth import (
    ADMINS,
    ANYONE,
    USERS,
    Caller,
    current_principal,
    rules_for,
)
from opentinker.services.common.grpc_server import abort_with
from opentinker.services.scheduler.tenants.identity import IdentityStore

log = structlog.get_logger(__name__)

ACCESS_RULES = {
    **rules_for(
        pb.DESCRIPTOR.services_by_name["AdminService"],
        {
            name: ADMINS
            for name in (
                "CreateTenant",
                "ListTenants",
                "CreateUser",
                "ListUsers",
                "CreateApiKey",
                "ListApiKeys",
                "RevokeApiKey",
                "CreateWorkerToken",
                "SetTenantQuota",
            )
        },
    ),
    **rules_for(
        pb.DESCRIPTOR.services_by_name["IdentityService"],
        {
            "Authenticate": ANYONE,
            "WhoAmI": USERS | frozenset({Caller.JOB, Caller.WORKER}),
        },
    ),
}


class AdminServicer(identity_pb2_grpc.AdminServiceServicer):
    def __init__(self, identity: IdentityStore) -> None:
        self._identity = identity

    async def CreateTenant(
        self, request: pb.CreateTenantRequest, context: grpc.aio.ServicerContext
    ):  # noqa: N802
        try:
            tenant = await self._identity.create_tenant(request.tenant_id, request.display_name)
        except OpenTinkerError as err:
            await abort_with(context, err)
        _audit("tenant_created", tenant_id=tenant.tenant_id)
        return pb.CreateTenantResponse(tenant=tenant)

    async def ListTenants(self, request: pb.ListTenantsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            page = await self._identity.list_tenants(
                page_size=request.page_size, page_token=request.page_token
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return pb.ListTenantsResponse(tenants=page.items, next_page_token=page.next_page_token)

    async def CreateUser(self, request: pb.CreateUserRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            user = await self._identity.create_user(
                request.user_id,
                request.tenant_id,
                display_name=request.display_name,
                role=request.role,
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        _audit("user_created", user_id=user.user_id, tenant_id=user.tenant_id)
        return pb.CreateUserResponse(user=user)

    async def ListUsers(self, request: pb.ListUsersRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            page = await self._identity.list_users(
                tenant_id=request.tenant_id,
                page_size=request.page_size,
                page_token=request.page_token,
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return pb.ListUsersResponse(users=page.items, next_page_token=page.next_page_token)

    async def CreateApiKey(
        self, request: pb.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ):  # noqa: N802
        try:
            key, info = await self._identity.create_api_key(request.user_id, label=request.label)
        except OpenTinkerError as err:
            await abort_with(context, err)
        _audit("api_key_created", key_prefix=info.key_prefix, user_id=info.user_id)
        return pb.CreateApiKeyResponse(api_key=key, info=info)

    async def ListApiKeys(self, request: pb.ListApiKeysRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            page = await self._identity.list_api_keys(
                tenant_id=request.tenant_id,
                page_size=request.page_size,
                page_token=request.page_token,
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return pb.ListApiKeysResponse(keys=page.items, next_page_token=page.next_page_token)

    async def RevokeApiKey(
        self, request: pb.RevokeApiKeyRequest, context: grpc.aio.ServicerContext
    ):  # noqa: N802
        try:
            info = await self._identity.revoke(request.key_prefix)
        except OpenTinkerError as err:
            await abort_with(context, err)
        _audit("api_key_revoked", key_prefix=info.key_prefix, user_id=info.user_id)
        return pb.RevokeApiKeyResponse(info=info)

    async def CreateWorkerToken(  # noqa: N802
        self, request: pb.CreateWorkerTokenRequest, context: grpc.aio.ServicerContext
    ):
        try:
            token, info = await self._identity.create_worker_token(
                worker_id=request.worker_id, label=request.label
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        _audit("worker_token_created", key_prefix=info.key_prefix, worker_id=info.worker_id)
        return pb.CreateWorkerTokenResponse(worker_token=token, info=info)

    async def SetTenantQuota(  # noqa: N802
        self, request: pb.SetTenantQuotaRequest, context: grpc.aio.ServicerContext
    ):
        try:
            tenant = await self._identity.set_quota(request.tenant_id, request.quota)
        except OpenTinkerError as err:
            await abort_with(context, err)
        q = tenant.quota
        _audit(
            "tenant_quota_set",
            tenant_id=tenant.tenant_id,
            max_devices=str(q.max_devices),
            device_seconds_per_period=str(q.device_seconds_per_period),
            period_s=str(q.period_s),
            max_priority=str(q.max_priority),
        )
        return pb.SetTenantQuotaResponse(tenant=tenant)


class IdentityServicer(identity_pb2_grpc.IdentityServiceServicer):
    def __init__(self, identity: IdentityStore) -> None:
        self._identity = identity

    async def Authenticate(
        self, request: pb.AuthenticateRequest, context: grpc.aio.ServicerContext
    ):  # noqa: N802
        try:
            principal = await self._identity.authenticate(request.credential)
        except OpenTinkerError as err:
            await abort_with(context, err)
        return pb.AuthenticateResponse(principal=principal.to_proto())

    async def WhoAmI(self, request: pb.WhoAmIRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return pb.WhoAmIResponse(principal=current_principal().to_proto())


def _audit(event: str, **fields: str) -> None:
    """Every change to identities is logged with the admin who made it (prefix, never key)."""
    log.info(event, by=current_principal().describe(), **fields)
