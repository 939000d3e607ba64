from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolSpec(_message.Message):
    __slots__ = ("name", "description", "parameters_json_schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json_schema: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json_schema: _Optional[str] = ...) -> None: ...

class EnvironmentSpec(_message.Message):
    __slots__ = ("name", "description", "system_prompt", "tools", "max_turns", "uses_images", "roles")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    USES_IMAGES_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    system_prompt: str
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    max_turns: int
    uses_images: bool
    roles: _containers.RepeatedCompositeFieldContainer[RoleSpec]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., system_prompt: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ..., max_turns: _Optional[int] = ..., uses_images: _Optional[bool] = ..., roles: _Optional[_Iterable[_Union[RoleSpec, _Mapping]]] = ...) -> None: ...

class RoleSpec(_message.Message):
    __slots__ = ("name", "system_prompt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    system_prompt: str
    def __init__(self, name: _Optional[str] = ..., system_prompt: _Optional[str] = ...) -> None: ...

class ImagePart(_message.Message):
    __slots__ = ("data", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class GetEnvironmentSpecRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEnvironmentSpecResponse(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: EnvironmentSpec
    def __init__(self, spec: _Optional[_Union[EnvironmentSpec, _Mapping]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("episode_id", "seed", "options")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    seed: int
    options: _containers.ScalarMap[str, str]
    def __init__(self, episode_id: _Optional[str] = ..., seed: _Optional[int] = ..., options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("system_prompt", "observation", "observation_images", "next_role")
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_IMAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROLE_FIELD_NUMBER: _ClassVar[int]
    system_prompt: str
    observation: str
    observation_images: _containers.RepeatedCompositeFieldContainer[ImagePart]
    next_role: str
    def __init__(self, system_prompt: _Optional[str] = ..., observation: _Optional[str] = ..., observation_images: _Optional[_Iterable[_Union[ImagePart, _Mapping]]] = ..., next_role: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "action", "tool_calls", "tool_call_errors")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    action: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, episode_id: _Optional[str] = ..., action: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_errors: _Optional[_Iterable[str]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("name", "arguments_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "done", "info", "observation_images", "next_role", "role_rewards")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class RoleRewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_IMAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_REWARDS_FIELD_NUMBER: _ClassVar[int]
    observation: str
    reward: float
    done: bool
    info: _containers.ScalarMap[str, str]
    observation_images: _containers.RepeatedCompositeFieldContainer[ImagePart]
    next_role: str
    role_rewards: _containers.ScalarMap[str, float]
    def __init__(self, observation: _Optional[str] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., info: _Optional[_Mapping[str, str]] = ..., observation_images: _Optional[_Iterable[_Union[ImagePart, _Mapping]]] = ..., next_role: _Optional[str] = ..., role_rewards: _Optional[_Mapping[str, float]] = ...) -> None: ...

class CloseEpisodeRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class CloseEpisodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
