from opentinker.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionLoss(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_LOSS_UNSPECIFIED: _ClassVar[SessionLoss]
    SESSION_LOSS_CROSS_ENTROPY: _ClassVar[SessionLoss]
    SESSION_LOSS_IMPORTANCE_SAMPLING: _ClassVar[SessionLoss]
    SESSION_LOSS_PPO: _ClassVar[SessionLoss]
    SESSION_LOSS_CISPO: _ClassVar[SessionLoss]
    SESSION_LOSS_GSPO: _ClassVar[SessionLoss]
    SESSION_LOSS_STABLE_REINFORCE: _ClassVar[SessionLoss]
    SESSION_LOSS_DRO: _ClassVar[SessionLoss]
SESSION_LOSS_UNSPECIFIED: SessionLoss
SESSION_LOSS_CROSS_ENTROPY: SessionLoss
SESSION_LOSS_IMPORTANCE_SAMPLING: SessionLoss
SESSION_LOSS_PPO: SessionLoss
SESSION_LOSS_CISPO: SessionLoss
SESSION_LOSS_GSPO: SessionLoss
SESSION_LOSS_STABLE_REINFORCE: SessionLoss
SESSION_LOSS_DRO: SessionLoss

class OpenHostedSessionRequest(_message.Message):
    __slots__ = ("launch_path", "rollout_address", "rollout_address_file")
    LAUNCH_PATH_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ADDRESS_FILE_FIELD_NUMBER: _ClassVar[int]
    launch_path: str
    rollout_address: str
    rollout_address_file: str
    def __init__(self, launch_path: _Optional[str] = ..., rollout_address: _Optional[str] = ..., rollout_address_file: _Optional[str] = ...) -> None: ...

class OpenHostedSessionResponse(_message.Message):
    __slots__ = ("endpoint", "ended", "exit_code", "sessions_hosted")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_HOSTED_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    ended: bool
    exit_code: int
    sessions_hosted: int
    def __init__(self, endpoint: _Optional[str] = ..., ended: _Optional[bool] = ..., exit_code: _Optional[int] = ..., sessions_hosted: _Optional[int] = ...) -> None: ...

class GetTrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainerStatusResponse(_message.Message):
    __slots__ = ("job_id", "step", "policy_version", "finetune", "trainable_parameters", "last_metrics")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINETUNE_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    policy_version: int
    finetune: _common_pb2.FinetuneMode
    trainable_parameters: int
    last_metrics: _containers.ScalarMap[str, float]
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., finetune: _Optional[_Union[_common_pb2.FinetuneMode, str]] = ..., trainable_parameters: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SessionCall(_message.Message):
    __slots__ = ("session_id", "seq")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq: int
    def __init__(self, session_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("input_tokens", "target_tokens", "weights", "sampling_logprobs", "advantages", "sequence_ratio_mask")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_RATIO_MASK_FIELD_NUMBER: _ClassVar[int]
    input_tokens: _containers.RepeatedScalarFieldContainer[int]
    target_tokens: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    sampling_logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    sequence_ratio_mask: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, input_tokens: _Optional[_Iterable[int]] = ..., target_tokens: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ..., sampling_logprobs: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ..., sequence_ratio_mask: _Optional[_Iterable[float]] = ...) -> None: ...

class LossConfig(_message.Message):
    __slots__ = ("loss", "clip_low_threshold", "clip_high_threshold", "kl_coeff")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CLIP_LOW_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    KL_COEFF_FIELD_NUMBER: _ClassVar[int]
    loss: SessionLoss
    clip_low_threshold: float
    clip_high_threshold: float
    kl_coeff: float
    def __init__(self, loss: _Optional[_Union[SessionLoss, str]] = ..., clip_low_threshold: _Optional[float] = ..., clip_high_threshold: _Optional[float] = ..., kl_coeff: _Optional[float] = ...) -> None: ...

class DatumOutput(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("call", "data", "loss")
    CALL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    call: SessionCall
    data: _containers.RepeatedCompositeFieldContainer[Datum]
    loss: LossConfig
    def __init__(self, call: _Optional[_Union[SessionCall, _Mapping]] = ..., data: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("loss", "outputs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    loss: float
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, loss: _Optional[float] = ..., outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("call", "data", "loss")
    CALL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    call: SessionCall
    data: _containers.RepeatedCompositeFieldContainer[Datum]
    loss: LossConfig
    def __init__(self, call: _Optional[_Union[SessionCall, _Mapping]] = ..., data: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("loss", "outputs", "metrics", "accumulated_calls")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_CALLS_FIELD_NUMBER: _ClassVar[int]
    loss: float
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    metrics: _containers.ScalarMap[str, float]
    accumulated_calls: int
    def __init__(self, loss: _Optional[float] = ..., outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., accumulated_calls: _Optional[int] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("call", "adam")
    CALL_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    call: SessionCall
    adam: AdamParams
    def __init__(self, call: _Optional[_Union[SessionCall, _Mapping]] = ..., adam: _Optional[_Union[AdamParams, _Mapping]] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("step", "grad_norm", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    grad_norm: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., grad_norm: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("call", "prompt_tokens", "num_samples", "sampling", "stop_token_ids", "seed", "include_prompt_logprobs", "policy_version", "greedy", "topk_prompt_logprobs", "topk_sample_logprobs")
    CALL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_SAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    call: SessionCall
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_samples: int
    sampling: _common_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    include_prompt_logprobs: bool
    policy_version: int
    greedy: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    def __init__(self, call: _Optional[_Union[SessionCall, _Mapping]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., num_samples: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., include_prompt_logprobs: _Optional[bool] = ..., policy_version: _Optional[int] = ..., greedy: _Optional[bool] = ..., topk_prompt_logprobs: _Optional[int] = ..., topk_sample_logprobs: _Optional[int] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "logprobs", "stop_reason", "topk_token_ids", "topk_logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TOPK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stop_reason: str
    topk_token_ids: _containers.RepeatedScalarFieldContainer[int]
    topk_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stop_reason: _Optional[str] = ..., topk_token_ids: _Optional[_Iterable[int]] = ..., topk_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("sequences", "policy_version", "prompt_logprobs", "topk_prompt_token_ids", "topk_prompt_logprobs")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    policy_version: int
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    topk_prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    topk_prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., policy_version: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., topk_prompt_token_ids: _Optional[_Iterable[int]] = ..., topk_prompt_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SaveWeightsForSamplerRequest(_message.Message):
    __slots__ = ("call",)
    CALL_FIELD_NUMBER: _ClassVar[int]
    call: SessionCall
    def __init__(self, call: _Optional[_Union[SessionCall, _Mapping]] = ...) -> None: ...

class SaveWeightsForSamplerResponse(_message.Message):
    __slots__ = ("policy_version", "probe_max_diff")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROBE_MAX_DIFF_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    probe_max_diff: float
    def __init__(self, policy_version: _Optional[int] = ..., probe_max_diff: _Optional[float] = ...) -> None: ...

class SaveStateRequest(_message.Message):
    __slots__ = ("call", "name")
    CALL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    call: SessionCall
    name: str
    def __init__(self, call: _Optional[_Union[SessionCall, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...

class SaveStateResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("call", "path")
    CALL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    call: SessionCall
    path: str
    def __init__(self, call: _Optional[_Union[SessionCall, _Mapping]] = ..., path: _Optional[str] = ...) -> None: ...

class LoadStateResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class GetSessionInfoRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetSessionInfoResponse(_message.Message):
    __slots__ = ("session_id", "model", "step", "policy_version", "last_seq", "accumulated_calls", "trainable_parameters", "idle_timeout_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_CALLS_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: _common_pb2.ModelSpec
    step: int
    policy_version: int
    last_seq: int
    accumulated_calls: int
    trainable_parameters: int
    idle_timeout_s: float
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[_Union[_common_pb2.ModelSpec, _Mapping]] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., last_seq: _Optional[int] = ..., accumulated_calls: _Optional[int] = ..., trainable_parameters: _Optional[int] = ..., idle_timeout_s: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("call",)
    CALL_FIELD_NUMBER: _ClassVar[int]
    call: SessionCall
    def __init__(self, call: _Optional[_Union[SessionCall, _Mapping]] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
