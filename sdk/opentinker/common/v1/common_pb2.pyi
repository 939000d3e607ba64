from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_KIND_UNSPECIFIED: _ClassVar[JobKind]
    JOB_KIND_RL: _ClassVar[JobKind]
    JOB_KIND_SFT: _ClassVar[JobKind]
    JOB_KIND_INFERENCE: _ClassVar[JobKind]
    JOB_KIND_SESSION: _ClassVar[JobKind]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_ALLOCATING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class FinetuneMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINETUNE_MODE_UNSPECIFIED: _ClassVar[FinetuneMode]
    FINETUNE_MODE_LORA: _ClassVar[FinetuneMode]
    FINETUNE_MODE_FULL: _ClassVar[FinetuneMode]

class LossKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_KIND_UNSPECIFIED: _ClassVar[LossKind]
    LOSS_KIND_GRPO: _ClassVar[LossKind]
    LOSS_KIND_PPO: _ClassVar[LossKind]
    LOSS_KIND_RLOO: _ClassVar[LossKind]
    LOSS_KIND_REINFORCE: _ClassVar[LossKind]

class LossNormalization(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_NORMALIZATION_UNSPECIFIED: _ClassVar[LossNormalization]
    LOSS_NORMALIZATION_SEQUENCE: _ClassVar[LossNormalization]
    LOSS_NORMALIZATION_TOKEN: _ClassVar[LossNormalization]
    LOSS_NORMALIZATION_CONSTANT: _ClassVar[LossNormalization]

class KlEstimator(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KL_ESTIMATOR_UNSPECIFIED: _ClassVar[KlEstimator]
    KL_ESTIMATOR_K1: _ClassVar[KlEstimator]
    KL_ESTIMATOR_K3: _ClassVar[KlEstimator]

class LrSchedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LR_SCHEDULE_UNSPECIFIED: _ClassVar[LrSchedule]
    LR_SCHEDULE_CONSTANT: _ClassVar[LrSchedule]
    LR_SCHEDULE_LINEAR: _ClassVar[LrSchedule]
    LR_SCHEDULE_COSINE: _ClassVar[LrSchedule]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    D_TYPE_UNSPECIFIED: _ClassVar[DType]
    D_TYPE_FLOAT32: _ClassVar[DType]
    D_TYPE_FLOAT16: _ClassVar[DType]
    D_TYPE_BFLOAT16: _ClassVar[DType]
    D_TYPE_INT64: _ClassVar[DType]

class OldLogprobs(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OLD_LOGPROBS_UNSPECIFIED: _ClassVar[OldLogprobs]
    OLD_LOGPROBS_AUTO: _ClassVar[OldLogprobs]
    OLD_LOGPROBS_ROLLOUT: _ClassVar[OldLogprobs]
    OLD_LOGPROBS_TRAINER: _ClassVar[OldLogprobs]

class RoleAdapters(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_ADAPTERS_UNSPECIFIED: _ClassVar[RoleAdapters]
    ROLE_ADAPTERS_PER_ROLE: _ClassVar[RoleAdapters]
    ROLE_ADAPTERS_SHARED: _ClassVar[RoleAdapters]
JOB_KIND_UNSPECIFIED: JobKind
JOB_KIND_RL: JobKind
JOB_KIND_SFT: JobKind
JOB_KIND_INFERENCE: JobKind
JOB_KIND_SESSION: JobKind
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_ALLOCATING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
FINETUNE_MODE_UNSPECIFIED: FinetuneMode
FINETUNE_MODE_LORA: FinetuneMode
FINETUNE_MODE_FULL: FinetuneMode
LOSS_KIND_UNSPECIFIED: LossKind
LOSS_KIND_GRPO: LossKind
LOSS_KIND_PPO: LossKind
LOSS_KIND_RLOO: LossKind
LOSS_KIND_REINFORCE: LossKind
LOSS_NORMALIZATION_UNSPECIFIED: LossNormalization
LOSS_NORMALIZATION_SEQUENCE: LossNormalization
LOSS_NORMALIZATION_TOKEN: LossNormalization
LOSS_NORMALIZATION_CONSTANT: LossNormalization
KL_ESTIMATOR_UNSPECIFIED: KlEstimator
KL_ESTIMATOR_K1: KlEstimator
KL_ESTIMATOR_K3: KlEstimator
LR_SCHEDULE_UNSPECIFIED: LrSchedule
LR_SCHEDULE_CONSTANT: LrSchedule
LR_SCHEDULE_LINEAR: LrSchedule
LR_SCHEDULE_COSINE: LrSchedule
D_TYPE_UNSPECIFIED: DType
D_TYPE_FLOAT32: DType
D_TYPE_FLOAT16: DType
D_TYPE_BFLOAT16: DType
D_TYPE_INT64: DType
OLD_LOGPROBS_UNSPECIFIED: OldLogprobs
OLD_LOGPROBS_AUTO: OldLogprobs
OLD_LOGPROBS_ROLLOUT: OldLogprobs
OLD_LOGPROBS_TRAINER: OldLogprobs
ROLE_ADAPTERS_UNSPECIFIED: RoleAdapters
ROLE_ADAPTERS_PER_ROLE: RoleAdapters
ROLE_ADAPTERS_SHARED: RoleAdapters
WORKER_PATH_FIELD_NUMBER: _ClassVar[int]
worker_path: _descriptor.FieldDescriptor

class LoraConfig(_message.Message):
    __slots__ = ("rank", "alpha", "dropout", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    dropout: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("base_model", "finetune", "lora", "init_adapter", "gradient_checkpointing", "chat_template")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    FINETUNE_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    INIT_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    finetune: FinetuneMode
    lora: LoraConfig
    init_adapter: str
    gradient_checkpointing: bool
    chat_template: str
    def __init__(self, base_model: _Optional[str] = ..., finetune: _Optional[_Union[FinetuneMode, str]] = ..., lora: _Optional[_Union[LoraConfig, _Mapping]] = ..., init_adapter: _Optional[str] = ..., gradient_checkpointing: _Optional[bool] = ..., chat_template: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_new_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class RlConfig(_message.Message):
    __slots__ = ("env_name", "env_options", "steps", "prompts_per_step", "samples_per_prompt", "learning_rate", "loss", "clip_epsilon", "sampling", "max_turns", "max_episode_tokens", "seed", "stop_at_reward", "checkpoint_every", "loss_normalization", "ppo_epochs", "minibatch_size", "kl_coef", "kl_estimator", "kl_in_reward", "entropy_coef", "warmup_steps", "lr_schedule", "weight_decay", "max_grad_norm", "gamma", "gae_lambda", "critic_learning_rate", "micro_batch_tokens", "val_every", "val_episodes", "val_temperature", "val_env_options", "val_first_episode", "max_staleness", "role_adapters", "max_padding_fraction", "old_logprobs", "tis_cap", "max_env_error_fraction", "env_error_window", "agent")
    class EnvOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ValEnvOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    ENV_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPSILON_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_REWARD_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    LOSS_NORMALIZATION_FIELD_NUMBER: _ClassVar[int]
    PPO_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    MINIBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    KL_IN_REWARD_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    GAE_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    CRITIC_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    VAL_EPISODES_FIELD_NUMBER: _ClassVar[int]
    VAL_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    VAL_ENV_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    VAL_FIRST_EPISODE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_PADDING_FRACTION_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    MAX_ENV_ERROR_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ENV_ERROR_WINDOW_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    env_options: _containers.ScalarMap[str, str]
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    learning_rate: float
    loss: LossKind
    clip_epsilon: float
    sampling: SamplingParams
    max_turns: int
    max_episode_tokens: int
    seed: int
    stop_at_reward: float
    checkpoint_every: int
    loss_normalization: LossNormalization
    ppo_epochs: int
    minibatch_size: int
    kl_coef: float
    kl_estimator: KlEstimator
    kl_in_reward: bool
    entropy_coef: float
    warmup_steps: int
    lr_schedule: LrSchedule
    weight_decay: float
    max_grad_norm: float
    gamma: float
    gae_lambda: float
    critic_learning_rate: float
    micro_batch_tokens: int
    val_every: int
    val_episodes: int
    val_temperature: float
    val_env_options: _containers.ScalarMap[str, str]
    val_first_episode: int
    max_staleness: int
    role_adapters: RoleAdapters
    max_padding_fraction: float
    old_logprobs: OldLogprobs
    tis_cap: float
    max_env_error_fraction: float
    env_error_window: int
    agent: AgentProgram
    def __init__(self, env_name: _Optional[str] = ..., env_options: _Optional[_Mapping[str, str]] = ..., steps: _Optional[int] = ..., prompts_per_step: _Optional[int] = ..., samples_per_prompt: _Optional[int] = ..., learning_rate: _Optional[float] = ..., loss: _Optional[_Union[LossKind, str]] = ..., clip_epsilon: _Optional[float] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_turns: _Optional[int] = ..., max_episode_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop_at_reward: _Optional[float] = ..., checkpoint_every: _Optional[int] = ..., loss_normalization: _Optional[_Union[LossNormalization, str]] = ..., ppo_epochs: _Optional[int] = ..., minibatch_size: _Optional[int] = ..., kl_coef: _Optional[float] = ..., kl_estimator: _Optional[_Union[KlEstimator, str]] = ..., kl_in_reward: _Optional[bool] = ..., entropy_coef: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., lr_schedule: _Optional[_Union[LrSchedule, str]] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., gamma: _Optional[float] = ..., gae_lambda: _Optional[float] = ..., critic_learning_rate: _Optional[float] = ..., micro_batch_tokens: _Optional[int] = ..., val_every: _Optional[int] = ..., val_episodes: _Optional[int] = ..., val_temperature: _Optional[float] = ..., val_env_options: _Optional[_Mapping[str, str]] = ..., val_first_episode: _Optional[int] = ..., max_staleness: _Optional[int] = ..., role_adapters: _Optional[_Union[RoleAdapters, str]] = ..., max_padding_fraction: _Optional[float] = ..., old_logprobs: _Optional[_Union[OldLogprobs, str]] = ..., tis_cap: _Optional[float] = ..., max_env_error_fraction: _Optional[float] = ..., env_error_window: _Optional[int] = ..., agent: _Optional[_Union[AgentProgram, _Mapping]] = ...) -> None: ...

class InferenceConfig(_message.Message):
    __slots__ = ("env_name", "env_options", "episodes", "concurrency", "sampling", "max_turns", "max_episode_tokens", "seed", "adapter_dir", "greedy", "max_env_error_fraction", "agent", "samples_per_episode")
    class EnvOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    ENV_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIR_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    MAX_ENV_ERROR_FRACTION_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_EPISODE_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    env_options: _containers.ScalarMap[str, str]
    episodes: int
    concurrency: int
    sampling: SamplingParams
    max_turns: int
    max_episode_tokens: int
    seed: int
    adapter_dir: str
    greedy: bool
    max_env_error_fraction: float
    agent: AgentProgram
    samples_per_episode: int
    def __init__(self, env_name: _Optional[str] = ..., env_options: _Optional[_Mapping[str, str]] = ..., episodes: _Optional[int] = ..., concurrency: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_turns: _Optional[int] = ..., max_episode_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., adapter_dir: _Optional[str] = ..., greedy: _Optional[bool] = ..., max_env_error_fraction: _Optional[float] = ..., agent: _Optional[_Union[AgentProgram, _Mapping]] = ..., samples_per_episode: _Optional[int] = ...) -> None: ...

class SftConfig(_message.Message):
    __slots__ = ("dataset_path", "validation_fraction", "validation_path", "epochs", "steps", "learning_rate", "max_tokens_per_batch", "packing", "max_sequence_length", "seed", "checkpoint_every", "eval_every", "max_grad_norm")
    DATASET_PATH_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_FRACTION_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_PATH_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    dataset_path: str
    validation_fraction: float
    validation_path: str
    epochs: int
    steps: int
    learning_rate: float
    max_tokens_per_batch: int
    packing: bool
    max_sequence_length: int
    seed: int
    checkpoint_every: int
    eval_every: int
    max_grad_norm: float
    def __init__(self, dataset_path: _Optional[str] = ..., validation_fraction: _Optional[float] = ..., validation_path: _Optional[str] = ..., epochs: _Optional[int] = ..., steps: _Optional[int] = ..., learning_rate: _Optional[float] = ..., max_tokens_per_batch: _Optional[int] = ..., packing: _Optional[bool] = ..., max_sequence_length: _Optional[int] = ..., seed: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., eval_every: _Optional[int] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "kind", "model", "rl", "num_devices", "priority", "sft", "inference", "session")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RL_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SFT_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: JobKind
    model: ModelSpec
    rl: RlConfig
    num_devices: int
    priority: int
    sft: SftConfig
    inference: InferenceConfig
    session: SessionConfig
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[JobKind, str]] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., rl: _Optional[_Union[RlConfig, _Mapping]] = ..., num_devices: _Optional[int] = ..., priority: _Optional[int] = ..., sft: _Optional[_Union[SftConfig, _Mapping]] = ..., inference: _Optional[_Union[InferenceConfig, _Mapping]] = ..., session: _Optional[_Union[SessionConfig, _Mapping]] = ...) -> None: ...

class SessionConfig(_message.Message):
    __slots__ = ("idle_timeout_s", "seed", "max_batch_tokens", "order_wait_s")
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ORDER_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    idle_timeout_s: float
    seed: int
    max_batch_tokens: int
    order_wait_s: float
    def __init__(self, idle_timeout_s: _Optional[float] = ..., seed: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., order_wait_s: _Optional[float] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "spec", "state", "reason", "created_unix_s", "updated_unix_s", "attempt", "worker_id", "checkpoint_uri", "final_metrics", "tenant_id", "owner_user_id", "endpoint", "worker_ids", "queue_position", "queue_reason")
    class FinalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    FINAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_USER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    state: JobState
    reason: str
    created_unix_s: float
    updated_unix_s: float
    attempt: int
    worker_id: str
    checkpoint_uri: str
    final_metrics: _containers.ScalarMap[str, float]
    tenant_id: str
    owner_user_id: str
    endpoint: str
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    queue_position: int
    queue_reason: str
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., created_unix_s: _Optional[float] = ..., updated_unix_s: _Optional[float] = ..., attempt: _Optional[int] = ..., worker_id: _Optional[str] = ..., checkpoint_uri: _Optional[str] = ..., final_metrics: _Optional[_Mapping[str, float]] = ..., tenant_id: _Optional[str] = ..., owner_user_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., worker_ids: _Optional[_Iterable[str]] = ..., queue_position: _Optional[int] = ..., queue_reason: _Optional[str] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "policy_version", "metrics", "env_error_reason")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ENV_ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    metrics: _containers.ScalarMap[str, float]
    env_error_reason: str
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., env_error_reason: _Optional[str] = ...) -> None: ...

class StateChange(_message.Message):
    __slots__ = ("state", "reason")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    reason: str
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "time_unix_s", "job_id", "state_change", "step", "log", "row")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_CHANGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time_unix_s: float
    job_id: str
    state_change: StateChange
    step: StepMetrics
    log: LogLine
    row: ResultRow
    def __init__(self, seq: _Optional[int] = ..., time_unix_s: _Optional[float] = ..., job_id: _Optional[str] = ..., state_change: _Optional[_Union[StateChange, _Mapping]] = ..., step: _Optional[_Union[StepMetrics, _Mapping]] = ..., log: _Optional[_Union[LogLine, _Mapping]] = ..., row: _Optional[_Union[ResultRow, _Mapping]] = ...) -> None: ...

class ResultRow(_message.Message):
    __slots__ = ("json", "index")
    JSON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    json: str
    index: int
    def __init__(self, json: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "data", "byte_offset", "total_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    data: bytes
    byte_offset: int
    total_bytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ..., byte_offset: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("time_unix_s",)
    TIME_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    time_unix_s: float
    def __init__(self, time_unix_s: _Optional[float] = ...) -> None: ...

class AgentProgram(_message.Message):
    __slots__ = ("callable", "command", "timeout_s")
    CALLABLE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    callable: str
    command: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    def __init__(self, callable: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...
