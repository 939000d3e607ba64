"""The RL section of a job spec: the environment, the size of a step, the algorithm's knobs,
validation during training; and its translation to and from the wire (common.proto RlConfig).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.spec_agent import AgentProgram, agent_fields, agent_to_proto
from opentinker.spec_parts import SamplingParams, sampling_fields, sampling_to_proto
from opentinker.spec_parts import StrictModel as _Strict


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
    max_turns: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="Model turns per episode; None = the environment's own limit "
        "(its EnvironmentSpec.max_turns, else 16).",
    )
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
    max_staleness: int = Field(
        1,
        ge=0,
        le=8,
        description="Policy versions a training batch may lag: 0 = strictly on-policy; 1 = the "
        "rollout generates the next batch while the trainer trains on this one.",
    )

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
    agent: AgentProgram | None = Field(
        None, description="An agent program plays each episode through the rollout's endpoint."
    )
    role_adapters: Literal["per_role", "shared"] = Field(
        "per_role",
        description="Multi-agent self-play (an env with roles) with LoRA: per_role trains one "
        "adapter per role on its own trajectories; shared trains one for all roles.",
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="Gradient accumulation: at most this many (padded) tokens per forward pass; "
        "0 = one pass per minibatch. At least max_episode_tokens.",
    )
    max_padding_fraction: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="A forward pass takes episodes of like length: it is cut where more than "
        "this share of its (padded) tokens would be padding, as when episodes of 1 and 8 turns "
        "share a batch (the gradient is the same; 1 = never cut for padding). Multi-device "
        "jobs take one pass per rank regardless.",
    )

    old_logprobs: Literal["auto", "rollout", "trainer"] = Field(
        "auto",
        description="The clipped ratio's old policy. rollout: the logprobs the rollout sampled "
        "with (free; exact when both sides compute in float32). trainer: the policy's own "
        "before the update, so the ratio starts at 1 whatever the rollout engine's numerics "
        "(bf16 vLLM), the mismatch corrected by tis_cap. auto: trainer when the policy is not "
        "float32 (GPU), else rollout.",
    )
    tis_cap: float = Field(
        2.0,
        ge=0.0,
        le=100.0,
        description="With trainer old logprobs: each token's policy-gradient term is weighted "
        "by min(exp(trainer - rollout logprob), tis_cap) (truncated importance sampling); "
        "0 = no weights.",
    )

    max_env_error_fraction: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="The job fails, naming the env and its errors, when more than this share "
        "of the episodes of the last env_error_window steps ended in an env error (raised, "
        "timed out, a NaN reward, an oversized observation, unreachable); 1 = never.",
    )
    env_error_window: int = Field(
        3,
        ge=1,
        le=1000,
        description="Steps over which max_env_error_fraction is judged (a job shorter than "
        "this is judged over all its steps at its last).",
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
        if self.kl_estimator == "k1" and self.kl_coef > 0 and not self.kl_in_reward:
            problems.append(
                "kl_estimator: k1 in the loss has a gradient of zero expectation (grad log pi), "
                "so it does not pull toward the reference; use k3, or kl_in_reward=true"
            )
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
        loss normalization); without max_turns (the env's limit, unknown here) the episode
        budget bounds it."""
        if self.max_turns is None:
            return self.max_episode_tokens
        return min(self.sampling.max_new_tokens * self.max_turns, self.max_episode_tokens)


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
_RL_OPTIONAL = (
    "max_grad_norm",
    "gamma",
    "gae_lambda",
    "max_staleness",
    "max_padding_fraction",
    "tis_cap",
    "max_env_error_fraction",
    "env_error_window",
)
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
_ROLE_ADAPTERS_TO_PB = {
    "per_role": common_pb2.ROLE_ADAPTERS_PER_ROLE,
    "shared": common_pb2.ROLE_ADAPTERS_SHARED,
}
_OLD_LOGPROBS_TO_PB = {
    "auto": common_pb2.OLD_LOGPROBS_AUTO,
    "rollout": common_pb2.OLD_LOGPROBS_ROLLOUT,
    "trainer": common_pb2.OLD_LOGPROBS_TRAINER,
}
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
    ("role_adapters", _ROLE_ADAPTERS_TO_PB),
    ("old_logprobs", _OLD_LOGPROBS_TO_PB),
)


def rl_to_proto(rl: RlConfig) -> common_pb2.RlConfig:
    """RlConfig -> wire message."""
    pb = common_pb2.RlConfig(
        env_name=rl.env_name,
        env_options=rl.env_options,
        steps=rl.steps,
        prompts_per_step=rl.prompts_per_step,
        samples_per_prompt=rl.samples_per_prompt,
        learning_rate=rl.learning_rate,
        clip_epsilon=rl.clip_epsilon,
        sampling=sampling_to_proto(rl.sampling),
        max_turns=rl.max_turns or 0,
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
    for key in _RL_ALGORITHM_NUMBERS + _RL_OPTIONAL:
        setattr(pb, key, getattr(rl, key))
    for key, table in _RL_ENUMS:
        setattr(pb, key, table[getattr(rl, key)])
    if rl.agent is not None:
        pb.agent.CopyFrom(agent_to_proto(rl.agent))
    return pb


def rl_fields(r: common_pb2.RlConfig) -> dict:
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
    if r.HasField("agent"):
        rl["agent"] = agent_fields(r.agent)
    return rl
