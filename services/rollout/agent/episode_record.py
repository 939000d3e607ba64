"""An episode as the agent loop plays it: its state, tokens, masks, rewards and messages.

``PlayedEpisode`` moves PENDING -> GENERATING <-> INTERACTING -> TERMINATED (agent_loop.py);
``ResetEpisodes`` is a batch whose episodes were reset ahead of their request
(batch_ahead.py).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentinker.services.modeling.vision_inputs import ImageInput
from opentinker.services.rollout.agent.loop_config import EnvSession, EpisodeRequest
from opentinker.services.rollout.types import ChatMessage, FinishReason


class EpisodeState(enum.Enum):
    PENDING = "PENDING"
    GENERATING = "GENERATING"
    INTERACTING = "INTERACTING"
    TERMINATED = "TERMINATED"


@dataclass
class PlayedEpisode:
    request: EpisodeRequest
    session: EnvSession  # the request's, or the one of its latest restart
    state: EpisodeState = EpisodeState.PENDING
    token_ids: list[int] = field(default_factory=list)
    prompt_length: int = 0
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_start: int = 0  # index in token_ids where the current model turn begins
    reward: float = 0.0
    num_turns: int = 0
    turn_rewards: list[float] = field(default_factory=list)  # one per env step
    turn_ends: list[int] = field(default_factory=list)  # completion index after the turn's tokens
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    info: dict[str, str] = field(default_factory=dict)
    retries: int = 0  # restarts after env failures (bounded by max_episode_retries)
    restarts: int = 0  # every restart, also those after the link to the envs was lost
    messages: list[ChatMessage] = field(default_factory=list)
    images: list[ImageInput] = field(default_factory=list)  # shown so far (vision envs)

    def start_over(self, session: EnvSession, *, env_failure: bool) -> None:
        """Forget everything played so far; the episode is PENDING on a new session."""
        self.session = session
        self.state = EpisodeState.PENDING
        self.token_ids, self.logprobs, self.loss_mask, self.messages = [], [], [], []
        self.images = []
        self.turn_rewards, self.turn_ends = [], []
        self.prompt_length = self.turn_start = self.num_turns = 0
        self.reward = 0.0
        self.info = {}
        self.retries += env_failure
        self.restarts += 1

    def append(self, ids: Sequence[int], logprobs: Sequence[float], mask: int) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.loss_mask.extend([mask] * len(ids))

    def finish(self, reason: FinishReason, detail: str = "") -> None:
        self.state = EpisodeState.TERMINATED
        self.finish_reason = reason
        self.finish_detail = detail


@dataclass(frozen=True)
class ResetEpisodes:
    """Episodes reset ahead of their batch (``AgentLoop.reset_ahead``), ready to generate;
    those still PENDING (past the first ``tried``, or their env was full) are reset when
    played."""

    episodes: list[PlayedEpisode]
    tried: int  # the first ``tried`` episodes were reset ahead

    @property
    def found_env_full(self) -> int:
        """Episodes tried ahead that found every env instance at capacity."""
        return sum(ep.state is EpisodeState.PENDING for ep in self.episodes[: self.tried])
