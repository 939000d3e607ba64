"""What one rollout session serves, validated from the trainer's ``OpenRollout``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from opentinker.common.v1 import common_pb2
from opentinker.errors import InvalidArgumentError
from opentinker.rollout.v1 import rollout_pb2
from opentinker.spec import ModelSpec, SamplingParams, validation_message
from opentinker.spec_agent import AgentProgram, agent_fields


class RolloutConfig(BaseModel):
    """One job's rollout: model, environment, sampling and per-episode budgets.

    max_episode_tokens counts the prompt and the completion of an episode. adapter_dir: a
    trained LoRA adapter served on ``model.base_model`` (inference); eval_env_options: merged
    over env_options for evaluation episodes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(..., min_length=1)
    model: ModelSpec
    # A training session's rollout: samples tokens (SampleTokens), never plays episodes.
    # (Declared before env_name: env_name's check reads it.)
    sampling_only: bool = False
    env_name: str = Field("", validate_default=True)  # required unless sampling_only
    env_options: dict[str, str] = {}
    sampling: SamplingParams = SamplingParams()
    max_turns: int | None = Field(None, ge=1)  # None = the env's own limit (agent_loop)
    max_episode_tokens: int = Field(2048, ge=8)
    seed: int = Field(0, ge=0)
    adapter_dir: str = ""
    eval_env_options: dict[str, str] = {}
    role_adapters: bool = False  # one LoRA adapter per role of a multi-agent env
    agent: AgentProgram | None = None  # plays each episode through the endpoint (agent_endpoint)

    @field_validator("env_name")
    @classmethod
    def _env_unless_sampling_only(cls, value: str, info: ValidationInfo) -> str:
        if not value and not info.data.get("sampling_only"):
            raise ValueError("String should have at least 1 character (unless sampling_only)")
        return value


_FINETUNE = {common_pb2.FINETUNE_MODE_LORA: "lora", common_pb2.FINETUNE_MODE_FULL: "full"}


def config_from_proto(msg: rollout_pb2.OpenRollout) -> RolloutConfig:
    """Validate an OpenRollout; unset (zero) numbers take the defaults, as proto3 cannot tell.

    Raises InvalidArgumentError naming every bad field.
    """
    model: dict = {"base_model": msg.model.base_model}
    if msg.model.finetune:
        model["finetune"] = _FINETUNE.get(msg.model.finetune, f"unknown mode {msg.model.finetune}")
    lora = msg.model.lora
    model["lora"] = {
        key: value
        for key, value in {
            "rank": lora.rank,
            "alpha": lora.alpha,
            "dropout": lora.dropout,
            "target_modules": tuple(lora.target_modules),
        }.items()
        if value
    }
    if msg.model.init_adapter:
        model["init_adapter"] = msg.model.init_adapter
    data: dict = {
        "job_id": msg.job_id,
        "model": model,
        "env_name": msg.env_name,
        "env_options": dict(msg.env_options),
        "adapter_dir": msg.adapter_dir,
        "eval_env_options": dict(msg.eval_env_options),
        "role_adapters": msg.role_adapters,
        "seed": msg.seed,
        "sampling_only": msg.sampling_only,
        "sampling": _sampling_fields(msg.sampling),
    }
    if msg.HasField("agent"):
        data["agent"] = agent_fields(msg.agent)
    if msg.max_turns:
        data["max_turns"] = msg.max_turns
    if msg.max_episode_tokens:
        data["max_episode_tokens"] = msg.max_episode_tokens
    try:
        return RolloutConfig.model_validate(data)
    except ValidationError as err:
        raise InvalidArgumentError(
            f"invalid OpenRollout: {validation_message(err)}", code="INVALID_ARGUMENT"
        ) from err


def _sampling_fields(pb: common_pb2.SamplingParams) -> dict:
    """The set fields of a wire SamplingParams (unset = the default)."""
    fields = {"temperature": pb.temperature, "top_p": pb.top_p, "max_new_tokens": pb.max_new_tokens}
    return {key: value for key, value in fields.items() if value}


def sampling_from_proto(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Validate wire SamplingParams; raises InvalidArgumentError naming every bad field."""
    try:
        return SamplingParams.model_validate(_sampling_fields(pb))
    except ValidationError as err:
        raise InvalidArgumentError(
            f"invalid sampling: {validation_message(err)}", code="INVALID_ARGUMENT"
        ) from err
