"""Trajectories as the trainer sees them, and their collation into padded tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentinker.services.modeling.vision_inputs import ImageInput


@dataclass(frozen=True)
class Episode:
    """One trajectory from the rollout, free of protobuf.

    token_ids: prompt (prompt_length ids) followed by the completion (model and env tokens).
    logprobs, loss_mask: one entry per completion token (len(token_ids) - prompt_length);
    logprobs are the sampling logprobs (0 on env tokens), loss_mask is 1 on model tokens.
    """

    group_index: int
    policy_version: int
    token_ids: list[int]
    prompt_length: int
    logprobs: list[float]
    loss_mask: list[int]
    reward: float
    env_error: bool
    finish_detail: str = ""
    num_turns: int = 1
    outcome: str = ""  # the env's info["outcome"] on its last step: win | loss | draw | ""
    truncated_by: str = ""  # "max_turns" | "max_tokens": a rollout budget ended it, not the env
    # Multi-turn credit: the reward of each env step, and the completion-token index just after
    # the last model token of each turn (exclusive end). Empty = one turn ending at the end of
    # the completion, with ``reward``.
    turn_rewards: tuple[float, ...] = ()
    turn_ends: tuple[int, ...] = ()
    # The images the episode showed (vision envs), in the order of their placeholder tokens;
    # the forward recomputes their pixel inputs (``vision_logprobs``).
    images: tuple[ImageInput, ...] = ()
    role: str = ""  # multi-agent env: the role whose view this is ('' = one agent)
    episode_id: str = ""  # the game it comes from (a self-play game gives one per role)
    # Agent-program episodes (rollout agent_endpoint): calls whose conversation the agent had
    # rewritten, so they started a new token segment; None = played by the agent loop.
    agent_rewrites: int | None = None

    @property
    def completion_length(self) -> int:
        return len(self.token_ids) - self.prompt_length

    def turns(self) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """(turn rewards, turn ends), a single turn when the rollout sent none."""
        if self.turn_rewards:
            return self.turn_rewards, self.turn_ends
        return (self.reward,), (self.completion_length,)


@dataclass(frozen=True)
class CollectedBatch:
    """One step's episodes with the rollout's own timing (seconds) and token count."""

    episodes: list[Episode]
    generate_seconds: float
    env_seconds: float
    generated_tokens: int


@dataclass(frozen=True)
class SequenceBatch:
    """Right-padded sequences for one forward pass. ``B`` sequences, ``L`` = longest length.

    tokens_B_L: token ids, padded with pad_id.
    attention_mask_B_L: 1 on real tokens, 0 on padding.
    Next-token targets (``T = L - 1`` positions, position t predicts token t+1):
    loss_mask_B_T: 1 where token t+1 is a model-generated completion token to train on.
    old_logprobs_B_T: the sampling logprob of token t+1 (0 where loss_mask is 0).
    images: every row's images, row by row, in the order of their placeholder tokens (vision
    episodes; the forward recomputes their pixel inputs).
    """

    tokens_B_L: torch.Tensor
    attention_mask_B_L: torch.Tensor
    loss_mask_B_T: torch.Tensor
    old_logprobs_B_T: torch.Tensor
    images: tuple[ImageInput, ...] = ()

    @property
    def num_sequences(self) -> int:
        return int(self.tokens_B_L.shape[0])


def collate(episodes: list[Episode], pad_id: int) -> SequenceBatch:
    """Pad episodes to one SequenceBatch, aligning completion fields to next-token positions."""
    if not episodes:
        raise ValueError("cannot collate an empty list of episodes")
    for ep in episodes:
        completion = len(ep.token_ids) - ep.prompt_length
        if (
            ep.prompt_length < 1
            or len(ep.loss_mask) != completion
            or len(ep.logprobs) != completion
        ):
            raise ValueError(
                f"malformed trajectory: {len(ep.token_ids)} tokens, prompt_length "
                f"{ep.prompt_length}, {len(ep.loss_mask)} mask and {len(ep.logprobs)} logprob "
                f"entries (expected {completion} each)"
            )
    length = max(len(e.token_ids) for e in episodes)
    size = len(episodes)
    tokens_B_L = torch.full((size, length), pad_id, dtype=torch.long)
    attention_B_L = torch.zeros((size, length), dtype=torch.long)
    loss_mask_B_T = torch.zeros((size, length - 1), dtype=torch.float32)
    old_B_T = torch.zeros((size, length - 1), dtype=torch.float32)
    # Every row's tokens at once (one tensor op for the batch, not four per row).
    rows, cols = row_positions([len(e.token_ids) for e in episodes], [0] * size)
    tokens_B_L[rows, cols] = torch.tensor([t for e in episodes for t in e.token_ids])
    attention_B_L[rows, cols] = 1
    # Completion token k sits at position prompt_length + k and is predicted at t = that - 1.
    rows, cols = row_positions(
        [e.completion_length for e in episodes], [e.prompt_length - 1 for e in episodes]
    )
    loss_mask_B_T[rows, cols] = torch.tensor(
        [m for e in episodes for m in e.loss_mask], dtype=torch.float32
    )
    old_B_T[rows, cols] = torch.tensor(
        [lp for e in episodes for lp in e.logprobs], dtype=torch.float32
    )
    images = tuple(image for ep in episodes for image in ep.images)
    return SequenceBatch(
        tokens_B_L, attention_B_L, loss_mask_B_T, old_B_T * loss_mask_B_T, images=images
    )


def row_positions(counts: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of ``counts[b]`` consecutive cells from column ``starts[b]`` of each row
    b, all rows flattened in order."""
    counts_B = torch.tensor(counts)
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts_B)
    offsets_B = torch.cumsum(counts_B, 0) - counts_B  # each row's first flat index
    shift_B = torch.tensor(starts) - offsets_B
    return rows, torch.arange(int(counts_B.sum())) + shift_B[rows]
