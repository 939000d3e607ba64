"""Domain types of the rollout: completions, episodes, trajectories and batches.

Token-level fields are plain Python lists (one entry per token); nothing here knows gRPC.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from opentinker.services.modeling.vision_inputs import ImageInput


class FinishReason(enum.Enum):
    """Why an episode ended (mirrors rollout.v1.FinishReason)."""

    ENV_DONE = "ENV_DONE"  # the environment said done
    MAX_TURNS = "MAX_TURNS"  # the turn budget ran out
    MAX_TOKENS = "MAX_TOKENS"  # the token budget ran out
    ENV_ERROR = "ENV_ERROR"  # the environment failed or replied badly


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt.

    ``token_ids[t]`` is the t-th sampled token (ending with eos when the model stopped by
    itself); ``logprobs[t]`` is its log-probability under the policy at the sampling
    temperature. Both have length T_completion.
    """

    token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class ToolSpec:
    """A tool the environment executes: the model calls it by name with JSON arguments.

    parameters: the arguments' JSON schema (an object schema), as the chat template takes it.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RoleSpec:
    """One agent of a multi-agent env: its name and its own system prompt ('' = the env's)."""

    name: str
    system_prompt: str = ""


@dataclass(frozen=True)
class EnvSpec:
    """What an environment declares of itself (its ``EnvironmentSpec``).

    max_turns: the env's own turn limit per episode (all roles' turns together); 0 = none.
    tools: rendered into the prompt by the chat template; calls are parsed from model turns.
    roles: a multi-agent env's roles, in order; empty = one agent.
    """

    name: str = ""
    system_prompt: str = ""
    tools: tuple[ToolSpec, ...] = ()
    max_turns: int = 0
    roles: tuple[RoleSpec, ...] = ()

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(role.name for role in self.roles)


@dataclass(frozen=True)
class ResetResult:
    """What an environment shows at the start of an episode."""

    system_prompt: str
    observation: str  # the first user message
    images: tuple[ImageInput, ...] = ()  # shown before its text (vision-language envs)
    next_role: str = ""  # multi-agent env: the role the observation is for (acts first)


@dataclass(frozen=True)
class StepOutcome:
    """What an environment answers to one model turn."""

    observation: str  # the next user message, unless done
    reward: float
    done: bool
    info: dict[str, str] = field(default_factory=dict)
    images: tuple[ImageInput, ...] = ()  # shown before the next observation's text
    next_role: str = ""  # multi-agent env: the role the observation is for (acts next)
    # Multi-agent env: the reward each role got from this step (a role left out got 0).
    role_rewards: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatMessage:
    """One turn of an episode as text: the system prompt, a user message, or a model turn."""

    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass
class Trajectory:
    """One finished episode.

    ``token_ids`` is the prompt (``prompt_length`` ids) followed by the completion; the
    per-completion-token lists ``logprobs`` and ``loss_mask`` have
    ``len(token_ids) - prompt_length`` entries: loss mask 1 and the sampling logprob on model
    tokens, loss mask 0 and logprob 0.0 on tokens the environment (or the chat format) added.

    ``turn_rewards``/``turn_ends``: the reward of each env step and the completion-token index
    just after the model tokens of that turn (exclusive), for per-turn returns.

    ``info`` is the env's info of the episode's last step (e.g. ``{"outcome": "win"}``);
    ``env_retries`` counts restarts of the episode after its env instance died; ``messages``
    is the episode as text (for people and jsonl; training uses the token ids only).

    ``role``: in a multi-agent env, the role whose view this is (one trajectory per role per
    game); its rewards are that role's and only its own turns have loss mask 1. '' otherwise.
    """

    episode_id: str
    group_index: int
    token_ids: list[int]
    prompt_length: int
    logprobs: list[float]
    loss_mask: list[int]
    reward: float
    num_turns: int
    finish_reason: FinishReason
    finish_detail: str = ""
    completion_text: str = ""
    policy_version: int = 0
    info: dict[str, str] = field(default_factory=dict)
    env_retries: int = 0
    messages: list[ChatMessage] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    # Every image shown, in the order of their placeholder tokens in token_ids (vision envs).
    images: list[ImageInput] = field(default_factory=list)
    role: str = ""


@dataclass
class RolloutStats:
    """Where the time of a batch went: seconds generating, seconds waiting on the env; and
    how many episode restarts (after a dead env instance) it took."""

    generate_seconds: float = 0.0
    env_seconds: float = 0.0
    generated_tokens: int = 0
    env_retries: int = 0

    def add(self, other: RolloutStats) -> None:
        self.generate_seconds += other.generate_seconds
        self.env_seconds += other.env_seconds
        self.generated_tokens += other.generated_tokens
        self.env_retries += other.env_retries


@dataclass
class TrajectoryBatch:
    """The trajectories of one CollectTrajectories request, in (group, sample) order."""

    batch_index: int
    trajectories: list[Trajectory]
    stats: RolloutStats
