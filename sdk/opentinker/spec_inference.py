"""The inference job's spec (``JobSpec.inference``) and its translation to and from the wire.

spec = JobSpec(
    kind="inference",
    model=ModelSpec(base_model="runs/job-1/checkpoint"),
    inference=InferenceConfig(env_name="letter", episodes=64),
)
"""

from __future__ import annotations

from pydantic import Field, model_validator

from opentinker.common.v1 import common_pb2
from opentinker.spec_agent import AgentProgram, agent_fields, agent_to_proto
from opentinker.spec_parts import SamplingParams, StrictModel, sampling_fields, sampling_to_proto

MAX_INFERENCE_EPISODES = 10_000  # every row stays in the job's event stream: keep it bounded


class InferenceConfig(StrictModel):
    """Play ``episodes`` episodes of a registered environment with the job's model.

    The model is ``JobSpec.model.base_model`` (a base model, or a full checkpoint directory);
    with ``adapter_dir`` that LoRA adapter is applied to it. A base_model directory holding
    ``adapter_config.json`` is itself loaded as an adapter on the base it names.
    """

    env_name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    env_options: dict[str, str] = {}
    episodes: int = Field(16, ge=1, le=MAX_INFERENCE_EPISODES)
    concurrency: int = Field(32, ge=1, le=4096, description="Episodes played together.")
    sampling: SamplingParams = SamplingParams()
    max_turns: int | None = Field(
        None, ge=1, le=1000, description="Turns per episode; None = the environment's own limit."
    )
    max_episode_tokens: int = Field(2048, ge=8, le=1_000_000)
    seed: int = Field(0, ge=0)
    adapter_dir: str = Field("", description="A saved PEFT adapter applied to model.base_model.")
    greedy: bool = Field(False, description="Argmax decoding; sampling.temperature is ignored.")
    agent: AgentProgram | None = Field(
        None, description="An agent program plays each episode through the rollout's endpoint."
    )
    samples_per_episode: int = Field(
        1,
        ge=1,
        le=1000,
        description="Times each episode (one env seed) is played: episodes x this many rows; "
        "pass@k up to k = this.",
    )
    max_env_error_fraction: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="The job fails, naming the env and its errors, when more than this share "
        "of its episodes ended in an env error; 1 = never.",
    )

    @model_validator(mode="after")
    def _samples_fit(self) -> InferenceConfig:
        rows = self.episodes * self.samples_per_episode
        if rows > MAX_INFERENCE_EPISODES:
            raise ValueError(
                f"samples_per_episode: episodes x samples_per_episode is {rows}, more than "
                f"{MAX_INFERENCE_EPISODES} rows; play fewer episodes or samples"
            )
        if self.samples_per_episode > 1 and self.greedy:
            raise ValueError(
                "samples_per_episode: greedy decoding plays every sample of an episode the "
                "same; sample (greedy false, a temperature > 0) to estimate pass@k"
            )
        return self


def inference_to_proto(c: InferenceConfig) -> common_pb2.InferenceConfig:
    return common_pb2.InferenceConfig(
        env_name=c.env_name,
        env_options=c.env_options,
        episodes=c.episodes,
        concurrency=c.concurrency,
        sampling=sampling_to_proto(c.sampling),
        max_turns=c.max_turns or 0,
        max_episode_tokens=c.max_episode_tokens,
        seed=c.seed,
        adapter_dir=c.adapter_dir,
        greedy=c.greedy,
        agent=agent_to_proto(c.agent) if c.agent is not None else None,
        samples_per_episode=c.samples_per_episode,
        max_env_error_fraction=c.max_env_error_fraction,
    )


def inference_fields(c: common_pb2.InferenceConfig) -> dict:
    """The set fields of a wire InferenceConfig, as JobSpec input (unset = the default)."""
    data: dict = {"env_name": c.env_name, "env_options": dict(c.env_options)}
    keys = ("episodes", "concurrency", "max_turns", "max_episode_tokens", "seed")
    for key in (*keys, "samples_per_episode"):
        if value := getattr(c, key):
            data[key] = value
    if c.adapter_dir:
        data["adapter_dir"] = c.adapter_dir
    if c.greedy:
        data["greedy"] = True
    if c.HasField("max_env_error_fraction"):
        data["max_env_error_fraction"] = c.max_env_error_fraction
    if c.HasField("sampling"):
        data["sampling"] = sampling_fields(c.sampling)
    if c.HasField("agent"):
        data["agent"] = agent_fields(c.agent)
    return data
