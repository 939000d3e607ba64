from opentinker.common.v1 import common_pb2 as _common_pb2
from opentinker.envhub.v1 import environment_pb2 as _environment_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_UNSPECIFIED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_INLINE: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_SHARED_MEMORY: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_CUDA_IPC: _ClassVar[WeightTransport]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_ENV_DONE: _ClassVar[FinishReason]
    FINISH_REASON_MAX_TURNS: _ClassVar[FinishReason]
    FINISH_REASON_MAX_TOKENS: _ClassVar[FinishReason]
    FINISH_REASON_ENV_ERROR: _ClassVar[FinishReason]
WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport
WEIGHT_TRANSPORT_INLINE: WeightTransport
WEIGHT_TRANSPORT_SHARED_MEMORY: WeightTransport
WEIGHT_TRANSPORT_CUDA_IPC: WeightTransport
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_ENV_DONE: FinishReason
FINISH_REASON_MAX_TURNS: FinishReason
FINISH_REASON_MAX_TOKENS: FinishReason
FINISH_REASON_ENV_ERROR: FinishReason

class ScoreTokensRequest(_message.Message):
    __slots__ = ("token_ids", "top_k")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_k: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., top_k: _Optional[int] = ...) -> None: ...

class ScoreTokensResponse(_message.Message):
    __slots__ = ("logprobs", "policy_version", "top_token_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., policy_version: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SampleTokensRequest(_message.Message):
    __slots__ = ("prompt_tokens", "num_samples", "sampling", "stop_token_ids", "seed", "greedy")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_samples: int
    sampling: _common_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    greedy: bool
    def __init__(self, prompt_tokens: _Optional[_Iterable[int]] = ..., num_samples: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., greedy: _Optional[bool] = ...) -> None: ...

class SampledTokens(_message.Message):
    __slots__ = ("token_ids", "logprobs", "stopped")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stopped: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stopped: _Optional[bool] = ...) -> None: ...

class SampleTokensResponse(_message.Message):
    __slots__ = ("samples", "policy_version")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[SampledTokens]
    policy_version: int
    def __init__(self, samples: _Optional[_Iterable[_Union[SampledTokens, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class RolloutRequest(_message.Message):
    __slots__ = ("seq", "open", "weights", "collect", "heartbeat", "close")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    COLLECT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    open: OpenRollout
    weights: WeightChunk
    collect: CollectTrajectories
    heartbeat: _common_pb2.Heartbeat
    close: CloseRollout
    def __init__(self, seq: _Optional[int] = ..., open: _Optional[_Union[OpenRollout, _Mapping]] = ..., weights: _Optional[_Union[WeightChunk, _Mapping]] = ..., collect: _Optional[_Union[CollectTrajectories, _Mapping]] = ..., heartbeat: _Optional[_Union[_common_pb2.Heartbeat, _Mapping]] = ..., close: _Optional[_Union[CloseRollout, _Mapping]] = ...) -> None: ...

class OpenRollout(_message.Message):
    __slots__ = ("job_id", "model", "env_name", "env_options", "sampling", "max_turns", "max_episode_tokens", "seed", "adapter_dir", "eval_env_options", "sampling_only", "role_adapters", "weight_offer", "agent")
    class EnvOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EvalEnvOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    ENV_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIR_FIELD_NUMBER: _ClassVar[int]
    EVAL_ENV_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_ONLY_FIELD_NUMBER: _ClassVar[int]
    ROLE_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_OFFER_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model: _common_pb2.ModelSpec
    env_name: str
    env_options: _containers.ScalarMap[str, str]
    sampling: _common_pb2.SamplingParams
    max_turns: int
    max_episode_tokens: int
    seed: int
    adapter_dir: str
    eval_env_options: _containers.ScalarMap[str, str]
    sampling_only: bool
    role_adapters: bool
    weight_offer: WeightTransportOffer
    agent: _common_pb2.AgentProgram
    def __init__(self, job_id: _Optional[str] = ..., model: _Optional[_Union[_common_pb2.ModelSpec, _Mapping]] = ..., env_name: _Optional[str] = ..., env_options: _Optional[_Mapping[str, str]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_turns: _Optional[int] = ..., max_episode_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., adapter_dir: _Optional[str] = ..., eval_env_options: _Optional[_Mapping[str, str]] = ..., sampling_only: _Optional[bool] = ..., role_adapters: _Optional[bool] = ..., weight_offer: _Optional[_Union[WeightTransportOffer, _Mapping]] = ..., agent: _Optional[_Union[_common_pb2.AgentProgram, _Mapping]] = ...) -> None: ...

class WeightTransportOffer(_message.Message):
    __slots__ = ("probe_segment", "probe_nonce", "cuda_device_uuid")
    PROBE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PROBE_NONCE_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    probe_segment: str
    probe_nonce: bytes
    cuda_device_uuid: str
    def __init__(self, probe_segment: _Optional[str] = ..., probe_nonce: _Optional[bytes] = ..., cuda_device_uuid: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("policy_version", "is_adapter", "tensors", "last", "probe_token_ids", "segment", "shared", "cuda_ipc")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    IS_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    PROBE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    is_adapter: bool
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    last: bool
    probe_token_ids: _containers.RepeatedScalarFieldContainer[int]
    segment: str
    shared: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    cuda_ipc: _containers.RepeatedCompositeFieldContainer[CudaIpcTensor]
    def __init__(self, policy_version: _Optional[int] = ..., is_adapter: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., last: _Optional[bool] = ..., probe_token_ids: _Optional[_Iterable[int]] = ..., segment: _Optional[str] = ..., shared: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ..., cuda_ipc: _Optional[_Iterable[_Union[CudaIpcTensor, _Mapping]]] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: _common_pb2.DType
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CudaIpcTensor(_message.Message):
    __slots__ = ("name", "shape", "stride", "storage_offset", "dtype", "device_uuid", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    dtype: _common_pb2.DType
    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class CollectTrajectories(_message.Message):
    __slots__ = ("batch_index", "num_groups", "group_size", "evaluation", "first_episode", "eval_temperature")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_EPISODE_FIELD_NUMBER: _ClassVar[int]
    EVAL_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    num_groups: int
    group_size: int
    evaluation: bool
    first_episode: int
    eval_temperature: float
    def __init__(self, batch_index: _Optional[int] = ..., num_groups: _Optional[int] = ..., group_size: _Optional[int] = ..., evaluation: _Optional[bool] = ..., first_episode: _Optional[int] = ..., eval_temperature: _Optional[float] = ...) -> None: ...

class CloseRollout(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class RolloutResponse(_message.Message):
    __slots__ = ("seq", "opened", "applied", "batch", "failed", "heartbeat", "closed", "taken")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    seq: int
    opened: RolloutOpened
    applied: WeightsApplied
    batch: TrajectoryBatch
    failed: RolloutFailed
    heartbeat: _common_pb2.Heartbeat
    closed: RolloutClosed
    taken: WeightChunkTaken
    def __init__(self, seq: _Optional[int] = ..., opened: _Optional[_Union[RolloutOpened, _Mapping]] = ..., applied: _Optional[_Union[WeightsApplied, _Mapping]] = ..., batch: _Optional[_Union[TrajectoryBatch, _Mapping]] = ..., failed: _Optional[_Union[RolloutFailed, _Mapping]] = ..., heartbeat: _Optional[_Union[_common_pb2.Heartbeat, _Mapping]] = ..., closed: _Optional[_Union[RolloutClosed, _Mapping]] = ..., taken: _Optional[_Union[WeightChunkTaken, _Mapping]] = ...) -> None: ...

class RolloutOpened(_message.Message):
    __slots__ = ("engine", "policy_version", "roles", "weight_transports", "weight_transport_detail")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSPORT_DETAIL_FIELD_NUMBER: _ClassVar[int]
    engine: str
    policy_version: int
    roles: _containers.RepeatedScalarFieldContainer[str]
    weight_transports: _containers.RepeatedScalarFieldContainer[WeightTransport]
    weight_transport_detail: str
    def __init__(self, engine: _Optional[str] = ..., policy_version: _Optional[int] = ..., roles: _Optional[_Iterable[str]] = ..., weight_transports: _Optional[_Iterable[_Union[WeightTransport, str]]] = ..., weight_transport_detail: _Optional[str] = ...) -> None: ...

class WeightChunkTaken(_message.Message):
    __slots__ = ("policy_version", "request_seq")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    request_seq: int
    def __init__(self, policy_version: _Optional[int] = ..., request_seq: _Optional[int] = ...) -> None: ...

class WeightsApplied(_message.Message):
    __slots__ = ("policy_version", "probe_logprobs", "apply_seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROBE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    probe_logprobs: _containers.RepeatedScalarFieldContainer[float]
    apply_seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., probe_logprobs: _Optional[_Iterable[float]] = ..., apply_seconds: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("episode_id", "group_index", "policy_version", "token_ids", "prompt_length", "logprobs", "loss_mask", "reward", "num_turns", "finish_reason", "finish_detail", "completion_text", "info", "env_retries", "turn_rewards", "turn_ends", "images", "role")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FINISH_DETAIL_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TEXT_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    ENV_RETRIES_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    TURN_ENDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    group_index: int
    policy_version: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    num_turns: int
    finish_reason: FinishReason
    finish_detail: str
    completion_text: str
    info: _containers.ScalarMap[str, str]
    env_retries: int
    turn_rewards: _containers.RepeatedScalarFieldContainer[float]
    turn_ends: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[_environment_pb2.ImagePart]
    role: str
    def __init__(self, episode_id: _Optional[str] = ..., group_index: _Optional[int] = ..., policy_version: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., num_turns: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., finish_detail: _Optional[str] = ..., completion_text: _Optional[str] = ..., info: _Optional[_Mapping[str, str]] = ..., env_retries: _Optional[int] = ..., turn_rewards: _Optional[_Iterable[float]] = ..., turn_ends: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[_environment_pb2.ImagePart, _Mapping]]] = ..., role: _Optional[str] = ...) -> None: ...

class TrajectoryBatch(_message.Message):
    __slots__ = ("batch_index", "trajectories", "generate_seconds", "env_seconds", "generated_tokens", "more")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    generate_seconds: float
    env_seconds: float
    generated_tokens: int
    more: bool
    def __init__(self, batch_index: _Optional[int] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., generate_seconds: _Optional[float] = ..., env_seconds: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., more: _Optional[bool] = ...) -> None: ...

class RolloutFailed(_message.Message):
    __slots__ = ("reason", "code")
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    code: str
    def __init__(self, reason: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...

class RolloutClosed(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...
