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

from pydantic import Field, ValidationError, field_validator, model_validator

from opentinker.chat_templates import check_chat_template_choice
from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.session_config import SessionConfig
from opentinker.spec_inference import InferenceConfig, inference_fields, inference_to_proto
from opentinker.spec_parts import SamplingParams
from opentinker.spec_parts import StrictModel as _Strict
from opentinker.spec_rl import RlConfig, rl_fields, rl_to_proto
from opentinker.spec_sft import SftConfig, sft_fields, sft_to_proto

__all__ = [
    "InferenceConfig",
    "JobSpec",
    "LoraConfig",
    "ModelSpec",
    "RlConfig",
    "SamplingParams",
    "SessionConfig",
    "SftConfig",
    "from_proto",
    "parse_job_spec",
    "to_proto",
    "validation_message",
]


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
    chat_template: str = Field(
        "",
        description="For a model whose tokenizer has no chat template: 'plain' (a documented "
        "simple format, opentinker.chat_templates) or a Jinja template. '' = the tokenizer's.",
    )

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        return check_chat_template_choice(value)

    @model_validator(mode="after")
    def _adapter_needs_lora(self) -> ModelSpec:
        if self.init_adapter is not None and self.finetune != "lora":
            raise ValueError(
                "init_adapter: a starting adapter needs finetune 'lora'; to start a full "
                "fine-tune from a full checkpoint, make that folder the base_model"
            )
        return self


_MISSING_SECTION = {
    "rl": "an RL job needs `rl` (at least rl.env_name)",
    "sft": "sft: an SFT job needs `sft` (at least sft.dataset_path)",
    "inference": "an inference job needs `inference` (at least inference.env_name)",
}


def data_parallel_problems(rl: RlConfig) -> list[str]:
    """Why an RL job with these settings cannot train on several ranks yet (empty: it can).
    Each rank runs one forward pass per step, and each is a collective."""
    problems = []
    if rl.kl_coef > 0:
        problems.append("kl_coef must be 0 (no reference model on several ranks yet)")
    if rl.loss == "ppo":
        problems.append("loss 'ppo' needs a critic, not sharded yet; use grpo/rloo/reinforce")
    if rl.micro_batch_tokens or rl.minibatch_size or rl.ppo_epochs != 1:
        problems.append(
            "micro_batch_tokens 0, minibatch_size 0 and ppo_epochs 1 (one forward pass per rank "
            "per step: each is a collective)"
        )
    return problems


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
        if self.kind == "rl" and self.rl is not None and self.num_devices > 1:
            problems = data_parallel_problems(self.rl)
            if problems:
                raise ValueError(
                    f"num_devices: {self.num_devices} devices train on {self.num_devices} "
                    f"ranks, which needs " + "; ".join(problems) + " (or set num_devices 1)"
                )
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
            chat_template=spec.model.chat_template,
        ),
    )
    if spec.sft is not None:
        pb.sft.CopyFrom(sft_to_proto(spec.sft))
    if spec.session is not None:
        pb.session.CopyFrom(spec.session.to_proto())
    if spec.rl is not None:
        pb.rl.CopyFrom(rl_to_proto(spec.rl))
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
        data["rl"] = rl_fields(pb.rl)
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
    if m.chat_template:
        model["chat_template"] = m.chat_template
    return model
