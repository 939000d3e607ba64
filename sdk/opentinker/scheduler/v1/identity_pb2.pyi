from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrincipalKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRINCIPAL_KIND_UNSPECIFIED: _ClassVar[PrincipalKind]
    PRINCIPAL_KIND_USER: _ClassVar[PrincipalKind]
    PRINCIPAL_KIND_JOB: _ClassVar[PrincipalKind]
    PRINCIPAL_KIND_WORKER: _ClassVar[PrincipalKind]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_MEMBER: _ClassVar[Role]
    ROLE_ADMIN: _ClassVar[Role]
PRINCIPAL_KIND_UNSPECIFIED: PrincipalKind
PRINCIPAL_KIND_USER: PrincipalKind
PRINCIPAL_KIND_JOB: PrincipalKind
PRINCIPAL_KIND_WORKER: PrincipalKind
ROLE_UNSPECIFIED: Role
ROLE_MEMBER: Role
ROLE_ADMIN: Role

class Principal(_message.Message):
    __slots__ = ("kind", "key_prefix", "tenant_id", "user_id", "role", "job_id", "attempt", "worker_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    kind: PrincipalKind
    key_prefix: str
    tenant_id: str
    user_id: str
    role: Role
    job_id: str
    attempt: int
    worker_id: str
    def __init__(self, kind: _Optional[_Union[PrincipalKind, str]] = ..., key_prefix: _Optional[str] = ..., tenant_id: _Optional[str] = ..., user_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("tenant_id", "display_name", "created_unix_s", "quota")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    display_name: str
    created_unix_s: float
    quota: TenantQuota
    def __init__(self, tenant_id: _Optional[str] = ..., display_name: _Optional[str] = ..., created_unix_s: _Optional[float] = ..., quota: _Optional[_Union[TenantQuota, _Mapping]] = ...) -> None: ...

class TenantQuota(_message.Message):
    __slots__ = ("max_devices", "device_seconds_per_period", "period_s", "max_priority")
    MAX_DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_PER_PERIOD_FIELD_NUMBER: _ClassVar[int]
    PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    MAX_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    max_devices: int
    device_seconds_per_period: float
    period_s: float
    max_priority: int
    def __init__(self, max_devices: _Optional[int] = ..., device_seconds_per_period: _Optional[float] = ..., period_s: _Optional[float] = ..., max_priority: _Optional[int] = ...) -> None: ...

class User(_message.Message):
    __slots__ = ("user_id", "tenant_id", "display_name", "role", "created_unix_s")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    tenant_id: str
    display_name: str
    role: Role
    created_unix_s: float
    def __init__(self, user_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., display_name: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class ApiKeyInfo(_message.Message):
    __slots__ = ("key_prefix", "kind", "tenant_id", "user_id", "label", "created_unix_s", "last_used_unix_s", "revoked", "worker_id")
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    key_prefix: str
    kind: PrincipalKind
    tenant_id: str
    user_id: str
    label: str
    created_unix_s: float
    last_used_unix_s: float
    revoked: bool
    worker_id: str
    def __init__(self, key_prefix: _Optional[str] = ..., kind: _Optional[_Union[PrincipalKind, str]] = ..., tenant_id: _Optional[str] = ..., user_id: _Optional[str] = ..., label: _Optional[str] = ..., created_unix_s: _Optional[float] = ..., last_used_unix_s: _Optional[float] = ..., revoked: _Optional[bool] = ..., worker_id: _Optional[str] = ...) -> None: ...

class CreateTenantRequest(_message.Message):
    __slots__ = ("tenant_id", "display_name")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    display_name: str
    def __init__(self, tenant_id: _Optional[str] = ..., display_name: _Optional[str] = ...) -> None: ...

class CreateTenantResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants", "next_page_token")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    next_page_token: str
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CreateUserRequest(_message.Message):
    __slots__ = ("user_id", "tenant_id", "display_name", "role")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    tenant_id: str
    display_name: str
    role: Role
    def __init__(self, user_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., display_name: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ...) -> None: ...

class CreateUserResponse(_message.Message):
    __slots__ = ("user",)
    USER_FIELD_NUMBER: _ClassVar[int]
    user: User
    def __init__(self, user: _Optional[_Union[User, _Mapping]] = ...) -> None: ...

class ListUsersRequest(_message.Message):
    __slots__ = ("tenant_id", "page_size", "page_token")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    page_size: int
    page_token: str
    def __init__(self, tenant_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListUsersResponse(_message.Message):
    __slots__ = ("users", "next_page_token")
    USERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    users: _containers.RepeatedCompositeFieldContainer[User]
    next_page_token: str
    def __init__(self, users: _Optional[_Iterable[_Union[User, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CreateApiKeyRequest(_message.Message):
    __slots__ = ("user_id", "label")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    label: str
    def __init__(self, user_id: _Optional[str] = ..., label: _Optional[str] = ...) -> None: ...

class CreateApiKeyResponse(_message.Message):
    __slots__ = ("api_key", "info")
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    api_key: str
    info: ApiKeyInfo
    def __init__(self, api_key: _Optional[str] = ..., info: _Optional[_Union[ApiKeyInfo, _Mapping]] = ...) -> None: ...

class ListApiKeysRequest(_message.Message):
    __slots__ = ("tenant_id", "page_size", "page_token")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    page_size: int
    page_token: str
    def __init__(self, tenant_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListApiKeysResponse(_message.Message):
    __slots__ = ("keys", "next_page_token")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKeyInfo]
    next_page_token: str
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKeyInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RevokeApiKeyRequest(_message.Message):
    __slots__ = ("key_prefix",)
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    key_prefix: str
    def __init__(self, key_prefix: _Optional[str] = ...) -> None: ...

class RevokeApiKeyResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ApiKeyInfo
    def __init__(self, info: _Optional[_Union[ApiKeyInfo, _Mapping]] = ...) -> None: ...

class CreateWorkerTokenRequest(_message.Message):
    __slots__ = ("worker_id", "label")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    label: str
    def __init__(self, worker_id: _Optional[str] = ..., label: _Optional[str] = ...) -> None: ...

class CreateWorkerTokenResponse(_message.Message):
    __slots__ = ("worker_token", "info")
    WORKER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    worker_token: str
    info: ApiKeyInfo
    def __init__(self, worker_token: _Optional[str] = ..., info: _Optional[_Union[ApiKeyInfo, _Mapping]] = ...) -> None: ...

class SetTenantQuotaRequest(_message.Message):
    __slots__ = ("tenant_id", "quota")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    quota: TenantQuota
    def __init__(self, tenant_id: _Optional[str] = ..., quota: _Optional[_Union[TenantQuota, _Mapping]] = ...) -> None: ...

class SetTenantQuotaResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class AuthenticateRequest(_message.Message):
    __slots__ = ("credential",)
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    credential: str
    def __init__(self, credential: _Optional[str] = ...) -> None: ...

class AuthenticateResponse(_message.Message):
    __slots__ = ("principal",)
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    principal: Principal
    def __init__(self, principal: _Optional[_Union[Principal, _Mapping]] = ...) -> None: ...

class WhoAmIRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WhoAmIResponse(_message.Message):
    __slots__ = ("principal",)
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    principal: Principal
    def __init__(self, principal: _Optional[_Union[Principal, _Mapping]] = ...) -> None: ...
