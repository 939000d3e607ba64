from opentinker.common.v1 import common_pb2 as _common_pb2
from opentinker.envhub.v1 import environment_pb2 as _environment_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_HEALTH_UNSPECIFIED: _ClassVar[InstanceHealth]
    INSTANCE_HEALTH_SERVING: _ClassVar[InstanceHealth]
    INSTANCE_HEALTH_NOT_SERVING: _ClassVar[InstanceHealth]
INSTANCE_HEALTH_UNSPECIFIED: InstanceHealth
INSTANCE_HEALTH_SERVING: InstanceHealth
INSTANCE_HEALTH_NOT_SERVING: InstanceHealth

class EnvironmentInstance(_message.Message):
    __slots__ = ("instance_id", "env_name", "address", "capacity", "active_episodes", "registered_unix_s", "health", "tenant_id", "shared")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_EPISODES_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    env_name: str
    address: str
    capacity: int
    active_episodes: int
    registered_unix_s: float
    health: InstanceHealth
    tenant_id: str
    shared: bool
    def __init__(self, instance_id: _Optional[str] = ..., env_name: _Optional[str] = ..., address: _Optional[str] = ..., capacity: _Optional[int] = ..., active_episodes: _Optional[int] = ..., registered_unix_s: _Optional[float] = ..., health: _Optional[_Union[InstanceHealth, str]] = ..., tenant_id: _Optional[str] = ..., shared: _Optional[bool] = ...) -> None: ...

class RegisterEnvironmentRequest(_message.Message):
    __slots__ = ("env_name", "address", "capacity", "shared", "env_token")
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    ENV_TOKEN_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    address: str
    capacity: int
    shared: bool
    env_token: str
    def __init__(self, env_name: _Optional[str] = ..., address: _Optional[str] = ..., capacity: _Optional[int] = ..., shared: _Optional[bool] = ..., env_token: _Optional[str] = ...) -> None: ...

class RegisterEnvironmentResponse(_message.Message):
    __slots__ = ("instance", "renew_interval_s", "ttl_s")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RENEW_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    instance: EnvironmentInstance
    renew_interval_s: float
    ttl_s: float
    def __init__(self, instance: _Optional[_Union[EnvironmentInstance, _Mapping]] = ..., renew_interval_s: _Optional[float] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewRegistrationRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class RenewRegistrationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeregisterEnvironmentRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DeregisterEnvironmentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvironmentsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListEnvironmentsResponse(_message.Message):
    __slots__ = ("instances", "next_page_token")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[EnvironmentInstance]
    next_page_token: str
    def __init__(self, instances: _Optional[_Iterable[_Union[EnvironmentInstance, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RunEpisodesRequest(_message.Message):
    __slots__ = ("seq", "open", "reset", "step", "close_episode", "heartbeat", "calls")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSE_EPISODE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    open: OpenEpisodes
    reset: _environment_pb2.ResetRequest
    step: _environment_pb2.StepRequest
    close_episode: _environment_pb2.CloseEpisodeRequest
    heartbeat: _common_pb2.Heartbeat
    calls: EpisodeCalls
    def __init__(self, seq: _Optional[int] = ..., open: _Optional[_Union[OpenEpisodes, _Mapping]] = ..., reset: _Optional[_Union[_environment_pb2.ResetRequest, _Mapping]] = ..., step: _Optional[_Union[_environment_pb2.StepRequest, _Mapping]] = ..., close_episode: _Optional[_Union[_environment_pb2.CloseEpisodeRequest, _Mapping]] = ..., heartbeat: _Optional[_Union[_common_pb2.Heartbeat, _Mapping]] = ..., calls: _Optional[_Union[EpisodeCalls, _Mapping]] = ...) -> None: ...

class EpisodeCalls(_message.Message):
    __slots__ = ("resets", "steps", "closes")
    RESETS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CLOSES_FIELD_NUMBER: _ClassVar[int]
    resets: _containers.RepeatedCompositeFieldContainer[_environment_pb2.ResetRequest]
    steps: _containers.RepeatedCompositeFieldContainer[_environment_pb2.StepRequest]
    closes: _containers.RepeatedCompositeFieldContainer[_environment_pb2.CloseEpisodeRequest]
    def __init__(self, resets: _Optional[_Iterable[_Union[_environment_pb2.ResetRequest, _Mapping]]] = ..., steps: _Optional[_Iterable[_Union[_environment_pb2.StepRequest, _Mapping]]] = ..., closes: _Optional[_Iterable[_Union[_environment_pb2.CloseEpisodeRequest, _Mapping]]] = ...) -> None: ...

class OpenEpisodes(_message.Message):
    __slots__ = ("job_id", "env_name")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    env_name: str
    def __init__(self, job_id: _Optional[str] = ..., env_name: _Optional[str] = ...) -> None: ...

class RunEpisodesResponse(_message.Message):
    __slots__ = ("seq", "opened", "reset", "stepped", "failed", "heartbeat", "replies")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STEPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    opened: EpisodesOpened
    reset: EpisodeReset
    stepped: EpisodeStepped
    failed: EpisodeFailed
    heartbeat: _common_pb2.Heartbeat
    replies: EpisodeReplies
    def __init__(self, seq: _Optional[int] = ..., opened: _Optional[_Union[EpisodesOpened, _Mapping]] = ..., reset: _Optional[_Union[EpisodeReset, _Mapping]] = ..., stepped: _Optional[_Union[EpisodeStepped, _Mapping]] = ..., failed: _Optional[_Union[EpisodeFailed, _Mapping]] = ..., heartbeat: _Optional[_Union[_common_pb2.Heartbeat, _Mapping]] = ..., replies: _Optional[_Union[EpisodeReplies, _Mapping]] = ...) -> None: ...

class EpisodeReplies(_message.Message):
    __slots__ = ("resets", "stepped", "failed")
    RESETS_FIELD_NUMBER: _ClassVar[int]
    STEPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    resets: _containers.RepeatedCompositeFieldContainer[EpisodeReset]
    stepped: _containers.RepeatedCompositeFieldContainer[EpisodeStepped]
    failed: _containers.RepeatedCompositeFieldContainer[EpisodeFailed]
    def __init__(self, resets: _Optional[_Iterable[_Union[EpisodeReset, _Mapping]]] = ..., stepped: _Optional[_Iterable[_Union[EpisodeStepped, _Mapping]]] = ..., failed: _Optional[_Iterable[_Union[EpisodeFailed, _Mapping]]] = ...) -> None: ...

class EpisodesOpened(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _environment_pb2.EnvironmentSpec
    def __init__(self, spec: _Optional[_Union[_environment_pb2.EnvironmentSpec, _Mapping]] = ...) -> None: ...

class EpisodeReset(_message.Message):
    __slots__ = ("episode_id", "result")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    result: _environment_pb2.ResetResponse
    def __init__(self, episode_id: _Optional[str] = ..., result: _Optional[_Union[_environment_pb2.ResetResponse, _Mapping]] = ...) -> None: ...

class EpisodeStepped(_message.Message):
    __slots__ = ("episode_id", "result")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    result: _environment_pb2.StepResponse
    def __init__(self, episode_id: _Optional[str] = ..., result: _Optional[_Union[_environment_pb2.StepResponse, _Mapping]] = ...) -> None: ...

class EpisodeFailed(_message.Message):
    __slots__ = ("episode_id", "reason", "code")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    reason: str
    code: str
    def __init__(self, episode_id: _Optional[str] = ..., reason: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...
