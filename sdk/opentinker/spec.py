"""Job specs as pydantic models, and their translation to and from the wire.

The same models validate on the client (before anything is sent) and in the scheduler (before
a job is queued), so an invalid spec is refused with the field named, all problems at once.

Example::

    spec = JobSpec(
        name="letters",
        model=ModelSpec(base_model="Qwen/Qwen2.5-1.5B"),
        rl=RlConfig(env_name="letter", steps=200),
    )
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.session_config import SessionConfig
from opentinker.spec_inference import InferenceConfig, inference_fields, inference_to_proto
from opentinker.spec_parts import SamplingParams, sampling_fields, sampling_to_proto
from opentinker.spec_parts import StrictModel as _Strict
from opentinker.spec_sft import SftConfig, sft_fields, sft_to_proto


class LoraConfig(_Strict):
    """Low-rank adapter settings (peft)."""

    rank: int = Field(8, ge=1, le=1024)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


class ModelSpec(_Strict):
    """Which model to start from and which parameters to train."""

    base_model: str = Field(
        "Qwen/Qwen2.5-1.5B",
        min_length=1,
        description="Hugging Face id or local directory loadable with from_pretrained.",
    )
    finetune: Literal["lora", "full"] = "lora"
    lora: LoraConfig = LoraConfig()
    init_adapter: str | None = Field(
        None,
        min_length=1,
        description="A saved PEFT adapter folder (e.g. an SFT LoRA checkpoint) on the pool's "
        "filesystem that LoRA training starts from; its rank and target modules must equal "
        "`lora`'s. A full SFT checkpoint is a base_model instead.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute layer activations in the backward pass: less memory, more time.",
    )

    @model_validator(mode="after")
    def _adapter_needs_lora(self) -> ModelSpec:
        if self.init_adapter is not None and self.finetune != "lora":
            raise ValueError(
                "init_adapter: a starting adapter needs finetune 'lora'; to start a full "
                "fine-tune from a full checkpoint, make that folder the base_model"
            )
        return self


class RlConfig(_Strict):
    """One RL run: the environment, the size of a step, and how long to train."""

    env_name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    env_options: dict[str, str] = {}
    steps: int = Field(100, ge=1, le=1_000_000)
    prompts_per_step: int = Field(16, ge=1, le=65536)
    samples_per_prompt: int = Field(8, ge=2, le=1024, description="GRPO group size (>= 2).")
    learning_rate: float = Field(1e-5, gt=0, le=1.0)
    loss: Literal["grpo", "ppo", "rloo", "reinforce"] = Field(
        "grpo",
        description="grpo: group-normalized advantages; rloo: leave-one-out group baseline; "
        "reinforce: batch-mean baseline; ppo: GAE advantages from a value head (a critic). "
        "All use the clipped ratio.",
    )
    clip_epsilon: float = Field(0.2, gt=0, le=10)
    sampling: SamplingParams = SamplingParams()
    max_turns: int = Field(1, ge=1, le=1000)
    max_episode_tokens: int = Field(2048, ge=8, le=1_000_000)
    seed: int = Field(0, ge=0)
    stop_at_reward: float | None = Field(
        None, description="Stop early, successfully, when the 10-step mean reward reaches this."
    )
    checkpoint_every: int = Field(0, ge=0, description="Steps between checkpoints; 0 = final only.")
    # Validation during training (see common.proto RlConfig.val_every).
    val_every: int = Field(0, ge=0, description="Steps between validations; 0 = none.")
    val_episodes: int = Field(32, ge=1, le=10_000)
    val_temperature: float = Field(0.0, ge=0, le=10, description="0 = greedy.")
    val_env_options: dict[str, str] = Field(
        {}, description='Merged over env_options for validation, e.g. {"split": "validation"}.'
    )
    val_first_episode: int = Field(0, ge=0, description="Picks another fixed validation set.")

    loss_normalization: Literal["sequence", "token", "constant"] = Field(
        "sequence",
        description="sequence: per-sequence token mean, then mean over sequences (GRPO); token: "
        "token mean over the batch (DAPO); constant: sum / (sequences * max completion "
        "tokens) (Dr. GRPO).",
    )
    ppo_epochs: int = Field(1, ge=1, le=100, description="Passes over each batch.")
    minibatch_size: int = Field(
        0, ge=0, description="Sequences per optimizer step within a pass; 0 = the whole batch."
    )
    kl_coef: float = Field(0.0, ge=0, le=100, description="KL(policy || reference) weight.")
    kl_estimator: Literal["k1", "k3"] = "k3"
    kl_in_reward: bool = Field(
        False, description="Subtract kl_coef * KL from the per-token reward instead of the loss."
    )
    entropy_coef: float = Field(0.0, ge=0, le=10, description="Entropy bonus weight.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warmup.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Decay after warmup, to 0 at the last step (linear, cosine)."
    )
    weight_decay: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient-norm clip; 0 = no clip.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount per turn (per token for PPO).")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda (ppo).")
    critic_learning_rate: float = Field(
        0.0, ge=0, le=1.0, description="Value head learning rate; > 0 for ppo only."
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="Gradient accumulation: at most this many (padded) tokens per forward pass; "
        "0 = one pass per minibatch. At least max_episode_tokens.",
    )

    @model_validator(mode="after")
    def _algorithm_fits(self) -> RlConfig:
        problems = []
        if self.loss == "ppo" and self.critic_learning_rate <= 0:
            problems.append("critic_learning_rate: loss 'ppo' trains a value head; set it > 0")
        if self.loss != "ppo" and self.critic_learning_rate > 0:
            problems.append(f"critic_learning_rate: only 'ppo' has a critic, not {self.loss!r}")
        if self.kl_in_reward and self.kl_coef <= 0:
            problems.append("kl_in_reward: needs kl_coef > 0")
        if self.warmup_steps > self.steps:
            problems.append(f"warmup_steps: {self.warmup_steps} is more than steps {self.steps}")
        batch = self.prompts_per_step * self.samples_per_prompt
        if self.minibatch_size > batch:
            problems.append(
                f"minibatch_size: {self.minibatch_size} is more than the batch "
                f"(prompts_per_step * samples_per_prompt = {batch})"
            )
        if 0 < self.micro_batch_tokens < self.max_episode_tokens:
            problems.append(
                f"micro_batch_tokens: {self.micro_batch_tokens} cannot hold one episode of "
                f"max_episode_tokens {self.max_episode_tokens}; raise it or set 0"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def max_completion_tokens(self) -> int:
        """The most completion tokens an episode can have (the constant of ``constant``
        loss normalization)."""
        return min(self.sampling.max_new_tokens * self.max_turns, self.max_episode_tokens)



_MISSING_SECTION = {
    "rl": "an RL job needs `rl` (at least rl.env_name)",
    "sft": "sft: an SFT job needs `sft` (at least sft.dataset_path)",
    "inference": "an inference job needs `inference` (at least inference.env_name)",
}


class JobSpec(_Strict):
    """Everything the scheduler needs to run a job."""

    name: str = Field("job", min_length=1, max_length=128)
    kind: Literal["rl", "sft", "inference", "session"] = "rl"
    model: ModelSpec = ModelSpec()
    rl: RlConfig | None = None
    sft: SftConfig | None = None
    inference: InferenceConfig | None = None
    session: SessionConfig | None = None
    num_devices: int = Field(1, ge=1, le=4096)
    priority: int = Field(
        0,
        ge=0,
        le=1000,
        description="Higher runs first among your tenant's queued jobs (up to its max_priority).",
    )

    @model_validator(mode="after")
    def _kind_has_its_config(self) -> JobSpec:
        """Each kind's own section: required for that kind (a session's has defaults), refused
        for any other."""
        for kind in _KIND_TO_PB:
            if kind != self.kind and getattr(self, kind) is not None:
                raise ValueError(f"`{kind}` is for kind {kind!r}, not {self.kind!r}")
        if getattr(self, self.kind) is None and self.kind in _MISSING_SECTION:
            raise ValueError(_MISSING_SECTION[self.kind])
        return self


def validation_message(err: ValidationError) -> str:
    """Every problem of a pydantic error on one line each, naming the dotted field."""
    lines = []
    for problem in err.errors():
        field = ".".join(str(p) for p in problem["loc"]) or "spec"
        lines.append(f"{field}: {problem['msg']}")
    return "; ".join(lines)


def parse_job_spec(data: dict) -> JobSpec:
    """Validate a dict as a JobSpec; raises ConfigError naming every bad field."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            f"invalid job spec: {validation_message(err)}", reason="INVALID_SPEC"
        ) from err


_FINETUNE_TO_PB = {"lora": common_pb2.FINETUNE_MODE_LORA, "full": common_pb2.FINETUNE_MODE_FULL}
_FINETUNE_FROM_PB = {v: k for k, v in _FINETUNE_TO_PB.items()}
_KIND_TO_PB = {
    "rl": common_pb2.JOB_KIND_RL,
    "sft": common_pb2.JOB_KIND_SFT,
    "inference": common_pb2.JOB_KIND_INFERENCE,
    "session": common_pb2.JOB_KIND_SESSION,
}
# Numeric RlConfig fields taken from the wire when set (proto3 cannot tell 0 from unset).
_RL_NUMBERS: tuple[str, ...] = (
    "steps",
    "prompts_per_step",
    "samples_per_prompt",
    "learning_rate",
    "clip_epsilon",
    "max_turns",
    "max_episode_tokens",
    "seed",
    "checkpoint_every",
    "val_every",
    "val_episodes",
    "val_temperature",
    "val_first_episode",
)
# The algorithm's numeric fields (added with the losses), sent as they are.
_RL_ALGORITHM_NUMBERS = (
    "ppo_epochs",
    "minibatch_size",
    "kl_coef",
    "entropy_coef",
    "warmup_steps",
    "weight_decay",
    "critic_learning_rate",
    "micro_batch_tokens",
)
_RL_NUMBERS += _RL_ALGORITHM_NUMBERS
# proto3 `optional` RlConfig fields: taken from the wire when present (0 is a real value).
_RL_OPTIONAL = ("max_grad_norm", "gamma", "gae_lambda")
_LOSS_TO_PB = {
    "grpo": common_pb2.LOSS_KIND_GRPO,
    "ppo": common_pb2.LOSS_KIND_PPO,
    "rloo": common_pb2.LOSS_KIND_RLOO,
    "reinforce": common_pb2.LOSS_KIND_REINFORCE,
}
_NORMALIZATION_TO_PB = {
    "sequence": common_pb2.LOSS_NORMALIZATION_SEQUENCE,
    "token": common_pb2.LOSS_NORMALIZATION_TOKEN,
    "constant": common_pb2.LOSS_NORMALIZATION_CONSTANT,
}
_KL_TO_PB = {"k1": common_pb2.KL_ESTIMATOR_K1, "k3": common_pb2.KL_ESTIMATOR_K3}
_SCHEDULE_TO_PB = {
    "constant": common_pb2.LR_SCHEDULE_CONSTANT,
    "linear": common_pb2.LR_SCHEDULE_LINEAR,
    "cosine": common_pb2.LR_SCHEDULE_COSINE,
}
# RlConfig enum fields: (field name, pydantic value -> wire value); UNSPECIFIED = the default.
_RL_ENUMS = (
    ("loss", _LOSS_TO_PB),
    ("loss_normalization", _NORMALIZATION_TO_PB),
    ("kl_estimator", _KL_TO_PB),
    ("lr_schedule", _SCHEDULE_TO_PB),
)
_KIND_NAMES = {
    common_pb2.JOB_KIND_RL: "rl",
    common_pb2.JOB_KIND_SFT: "sft",
    common_pb2.JOB_KIND_INFERENCE: "inference",
    common_pb2.JOB_KIND_SESSION: "session",
}


def to_proto(spec: JobSpec) -> common_pb2.JobSpec:
    """JobSpec -> wire message."""
    pb = common_pb2.JobSpec(
        name=spec.name,
        kind=_KIND_TO_PB[spec.kind],
        num_devices=spec.num_devices,
        priority=spec.priority,
        model=common_pb2.ModelSpec(
            base_model=spec.model.base_model,
            finetune=_FINETUNE_TO_PB[spec.model.finetune],
            lora=common_pb2.LoraConfig(
                rank=spec.model.lora.rank,
                alpha=spec.model.lora.alpha,
                dropout=spec.model.lora.dropout,
                target_modules=list(spec.model.lora.target_modules),
            ),
            init_adapter=spec.model.init_adapter or "",
            gradient_checkpointing=spec.model.gradient_checkpointing,
        ),
    )
    if spec.sft is not None:
        pb.sft.CopyFrom(sft_to_proto(spec.sft))
    if spec.session is not None:
        pb.session.CopyFrom(spec.session.to_proto())
    if spec.rl is not None:
        rl = spec.rl
        pb.rl.CopyFrom(
            common_pb2.RlConfig(
                env_name=rl.env_name,
                env_options=rl.env_options,
                steps=rl.steps,
                prompts_per_step=rl.prompts_per_step,
                samples_per_prompt=rl.samples_per_prompt,
                learning_rate=rl.learning_rate,
                clip_epsilon=rl.clip_epsilon,
                sampling=sampling_to_proto(rl.sampling),
                max_turns=rl.max_turns,
                max_episode_tokens=rl.max_episode_tokens,
                seed=rl.seed,
                stop_at_reward=rl.stop_at_reward or 0.0,
                checkpoint_every=rl.checkpoint_every,
                val_every=rl.val_every,
                val_episodes=rl.val_episodes,
                val_temperature=rl.val_temperature,
                val_env_options=rl.val_env_options,
                val_first_episode=rl.val_first_episode,
                kl_in_reward=rl.kl_in_reward,
            )
        )
        for key in _RL_ALGORITHM_NUMBERS + _RL_OPTIONAL:
            setattr(pb.rl, key, getattr(rl, key))
        for key, table in _RL_ENUMS:
            setattr(pb.rl, key, table[getattr(rl, key)])
    if spec.inference is not None:
        pb.inference.CopyFrom(inference_to_proto(spec.inference))
    return pb


def from_proto(pb: common_pb2.JobSpec) -> JobSpec:
    """Wire message -> validated JobSpec; raises ConfigError naming every bad field.

    Unset (zero) numeric fields take the model's defaults, as proto3 cannot tell them apart.
    """
    name = _KIND_NAMES.get(pb.kind, "unspecified")
    if name not in _KIND_TO_PB:
        raise ConfigError(
            f"invalid job spec: kind: {name!r} jobs are not served yet; "
            f"use kind {' or '.join(map(repr, _KIND_TO_PB))}",
            reason="UNSUPPORTED_KIND",
        )
    data: dict = {"kind": name}
    if pb.name:
        data["name"] = pb.name
    if pb.num_devices:
        data["num_devices"] = pb.num_devices
    if pb.priority:
        data["priority"] = pb.priority
    if pb.HasField("model"):
        data["model"] = _model_fields(pb.model)
    if pb.HasField("rl"):
        data["rl"] = _rl_fields(pb.rl)
    if pb.HasField("sft"):
        data["sft"] = sft_fields(pb.sft)
    if pb.HasField("inference"):
        data["inference"] = inference_fields(pb.inference)
    if pb.HasField("session"):
        data["session"] = SessionConfig.fields_from_proto(pb.session)
    return parse_job_spec(data)


def _model_fields(m: common_pb2.ModelSpec) -> dict:
    """The set fields of a wire ModelSpec, as JobSpec input (unset = the model's default)."""
    model: dict = {}
    if m.base_model:
        model["base_model"] = m.base_model
    if m.finetune:
        if m.finetune not in _FINETUNE_FROM_PB:
            raise ConfigError(
                "invalid job spec: model.finetune: unknown mode", reason="INVALID_SPEC"
            )
        model["finetune"] = _FINETUNE_FROM_PB[m.finetune]
    if m.HasField("lora"):
        lora = {
            "rank": m.lora.rank,
            "alpha": m.lora.alpha,
            "dropout": m.lora.dropout,
            "target_modules": tuple(m.lora.target_modules),
        }
        model["lora"] = {k: v for k, v in lora.items() if v}
    if m.init_adapter:
        model["init_adapter"] = m.init_adapter
    if m.gradient_checkpointing:
        model["gradient_checkpointing"] = True
    return model


def _rl_fields(r: common_pb2.RlConfig) -> dict:
    """The set fields of a wire RlConfig, as JobSpec input (unset = the model's default)."""
    rl: dict = {"env_name": r.env_name, "env_options": dict(r.env_options)}
    if r.val_env_options:
        rl["val_env_options"] = dict(r.val_env_options)
    for key in _RL_NUMBERS:
        value = getattr(r, key)
        if value:
            rl[key] = value
    if r.stop_at_reward:
        rl["stop_at_reward"] = r.stop_at_reward
    for key in _RL_OPTIONAL:
        if r.HasField(key):
            rl[key] = getattr(r, key)
    if r.kl_in_reward:
        rl["kl_in_reward"] = True
    for key, table in _RL_ENUMS:
        wire = getattr(r, key)
        if wire:
            names = {v: k for k, v in table.items()}
            if wire not in names:
                raise ConfigError(
                    f"invalid job spec: rl.{key}: unknown value {wire}", reason="INVALID_SPEC"
                )
            rl[key] = names[wire]
    if r.HasField("sampling"):
        rl["sampling"] = sampling_fields(r.sampling)
    return rl
