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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute layer activations in the backward pass: less memory, more time.",
    )


class SamplingParams(_Strict):
    temperature: float = Field(1.0, gt=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(64, ge=1, le=32768)


class RlConfig(_Strict):
    """One RL run: the environment, the size of a step, and how long to train."""

    env_name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    env_options: dict[str, str] = {}
    steps: int = Field(100, ge=1, le=1_000_000)
    prompts_per_step: int = Field(16, ge=1, le=65536)
    samples_per_prompt: int = Field(8, ge=2, le=1024, description="GRPO group size (>= 2).")
    learning_rate: float = Field(1e-5, gt=0, le=1.0)
    loss: Literal["grpo"] = "grpo"
    clip_epsilon: float = Field(0.2, gt=0, le=10)
    sampling: SamplingParams = SamplingParams()
    max_turns: int = Field(1, ge=1, le=1000)
    max_episode_tokens: int = Field(2048, ge=8, le=1_000_000)
    seed: int = Field(0, ge=0)
    stop_at_reward: float | None = Field(
        None, description="Stop early, successfully, when the 10-step mean reward reaches this."
    )
    checkpoint_every: int = Field(0, ge=0, description="Steps between checkpoints; 0 = final only.")


class JobSpec(_Strict):
    """Everything the scheduler needs to run a job."""

    name: str = Field("job", min_length=1, max_length=128)
    kind: Literal["rl"] = "rl"
    model: ModelSpec = ModelSpec()
    rl: RlConfig | None = None
    num_devices: int = Field(1, ge=1, le=4096)
    priority: int = Field(
        0,
        ge=0,
        le=1000,
        description="Higher runs first among your tenant's queued jobs (up to its max_priority).",
    )

    @model_validator(mode="after")
    def _kind_has_its_config(self) -> JobSpec:
        if self.kind == "rl" and self.rl is None:
            raise ValueError("an RL job needs `rl` (at least rl.env_name)")
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
_KIND_TO_PB = {"rl": common_pb2.JOB_KIND_RL}
# Numeric RlConfig fields taken from the wire when set (proto3 cannot tell 0 from unset).
_RL_NUMBERS = (
    "steps",
    "prompts_per_step",
    "samples_per_prompt",
    "learning_rate",
    "clip_epsilon",
    "max_turns",
    "max_episode_tokens",
    "seed",
    "checkpoint_every",
)
_KIND_NAMES = {
    common_pb2.JOB_KIND_RL: "rl",
    common_pb2.JOB_KIND_SFT: "sft",
    common_pb2.JOB_KIND_INFERENCE: "inference",
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
            gradient_checkpointing=spec.model.gradient_checkpointing,
        ),
    )
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
                loss=common_pb2.LOSS_KIND_GRPO,
                clip_epsilon=rl.clip_epsilon,
                sampling=common_pb2.SamplingParams(
                    temperature=rl.sampling.temperature,
                    top_p=rl.sampling.top_p,
                    max_new_tokens=rl.sampling.max_new_tokens,
                ),
                max_turns=rl.max_turns,
                max_episode_tokens=rl.max_episode_tokens,
                seed=rl.seed,
                stop_at_reward=rl.stop_at_reward or 0.0,
                checkpoint_every=rl.checkpoint_every,
            )
        )
    return pb


def from_proto(pb: common_pb2.JobSpec) -> JobSpec:
    """Wire message -> validated JobSpec; raises ConfigError naming every bad field.

    Unset (zero) numeric fields take the model's defaults, as proto3 cannot tell them apart.
    """
    if pb.kind != common_pb2.JOB_KIND_RL:
        name = _KIND_NAMES.get(pb.kind, "unspecified")
        raise ConfigError(
            f"invalid job spec: kind: {name!r} jobs are not served yet; use kind 'rl'",
            reason="UNSUPPORTED_KIND",
        )
    data: dict = {"kind": "rl"}
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
    if m.gradient_checkpointing:
        model["gradient_checkpointing"] = True
    return model


def _rl_fields(r: common_pb2.RlConfig) -> dict:
    """The set fields of a wire RlConfig, as JobSpec input (unset = the model's default)."""
    rl: dict = {"env_name": r.env_name, "env_options": dict(r.env_options)}
    for key in _RL_NUMBERS:
        value = getattr(r, key)
        if value:
            rl[key] = value
    if r.stop_at_reward:
        rl["stop_at_reward"] = r.stop_at_reward
    if r.HasField("sampling"):
        s = r.sampling
        sampling = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_new_tokens": s.max_new_tokens,
        }
        rl["sampling"] = {k: v for k, v in sampling.items() if v}
    return rl
