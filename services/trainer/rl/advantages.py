"""Per-token advantages of a batch of episodes, for each loss of ``RlConfig.loss``.

Group and batch baselines (grpo, rloo, reinforce) work on episode returns. A multi-turn episode
with per-turn rewards credits each model token of turn k with the discounted return ``G_k``
(estimators/turn_returns.py); the baseline comes from the episodes' first-turn returns ``G_0``:

    A_t = adv(G_0)_b + (G_k(t) - G_0,b) * scale_b

where ``adv`` is the estimator applied to ``G_0`` and ``scale_b`` what it multiplies a reward
by (``1 / (std_g + eps)`` for grpo when the group's returns vary, else 1). A single-turn
episode has ``G_k = G_0`` and gets exactly the estimator's advantage.

PPO (``ppo``): the reward of each turn sits on the last model token of that turn, the critic's
values give GAE advantages (gamma per token), whitened over the batch's model tokens.

Layout: ``[B, T]`` aligned with ``collate`` (position t predicts token t+1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

import torch

from opentinker.services.trainer.estimators.gae import gae_advantages
from opentinker.services.trainer.estimators.grpo import ADVANTAGE_EPS, flat_groups, group_advantages
from opentinker.services.trainer.estimators.reinforce import batch_baseline_advantages
from opentinker.services.trainer.estimators.rloo import rloo_advantages
from opentinker.services.trainer.estimators.turn_returns import discounted_returns, token_returns
from opentinker.services.trainer.rl.agent_segments import rows_by_episode
from opentinker.services.trainer.rl.batch import Episode, row_positions

WHITEN_EPS = 1e-8


def _groups(episodes: Sequence[Episode]) -> list[list[int]]:
    """Indices of each group: same ``group_index`` and, in self-play, the same role (black's
    returns are never the baseline of white's, even when one adapter plays both)."""
    by_group: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, ep in enumerate(episodes):
        by_group[(ep.group_index, ep.role)].append(i)
    return list(by_group.values())


def baseline_advantages(
    returns_B: torch.Tensor, episodes: Sequence[Episode], loss: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage ``[B]``, reward scale ``[B]``) of each episode's return under ``loss``
    (grpo and rloo within groups of the same ``group_index`` and role, reinforce over the
    batch)."""
    if loss == "reinforce":
        return batch_baseline_advantages(returns_B), torch.ones_like(returns_B)
    advantages_B = torch.zeros_like(returns_B)
    scales_B = torch.ones_like(returns_B)
    for members in _groups(episodes):
        # An agent episode sent as several segment rows is one member of its group.
        at = rows_by_episode(members, episodes)
        firsts = [members[at.index(k)] for k in range(max(at) + 1)]
        rewards_1_N = returns_B[firsts].unsqueeze(0)
        if loss == "grpo":
            advantages_B[members] = group_advantages(rewards_1_N)[0][at]
            if not bool(flat_groups(rewards_1_N.double())):  # else no signal: scale 1
                std = float(rewards_1_N.double().std(unbiased=False))
                scales_B[members] = 1.0 / (std + ADVANTAGE_EPS)
        elif loss == "rloo":
            advantages_B[members] = rloo_advantages(rewards_1_N)[0][at]
        else:
            raise ValueError(f"no group baseline for loss {loss!r}")
    return advantages_B, scales_B


def episode_advantages(
    episodes: Sequence[Episode], loss: str = "grpo", reward_shift_B: torch.Tensor | None = None
) -> torch.Tensor:
    """The episode-level advantage ``[B]`` (of ``G_0``; reward_shift_B is added to it first,
    e.g. a KL penalty)."""
    returns_B = first_returns(episodes, gamma=1.0)
    if reward_shift_B is not None:
        returns_B = returns_B + reward_shift_B
    return baseline_advantages(returns_B, episodes, loss)[0]


def first_returns(episodes: Sequence[Episode], *, gamma: float) -> torch.Tensor:
    """``G_0`` of each episode ``[B]`` (the reward itself for single-turn episodes)."""
    return torch.tensor(
        [discounted_returns(ep.turns()[0], gamma)[0] for ep in episodes], dtype=torch.float32
    )


def token_advantages(
    episodes: Sequence[Episode],
    width: int,
    *,
    loss: str,
    gamma: float,
    reward_shift_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages ``[B, width]`` for grpo, rloo, reinforce (0 off the completion).

    ``reward_shift_B`` is added to the last turn's reward of each episode (a sequence KL
    penalty)."""
    episodes = [_shifted(ep, reward_shift_B, b) for b, ep in enumerate(episodes)]
    first_B = first_returns(episodes, gamma=gamma)
    advantages_B, scales_B = baseline_advantages(first_B, episodes, loss)
    advantages, first, scales = advantages_B.tolist(), first_B.tolist(), scales_B.tolist()
    values: list[float] = []  # every completion token's advantage, row after row
    for b, ep in enumerate(episodes):
        rewards, ends = ep.turns()
        if len(rewards) == 1 and 0 <= ends[0] <= ep.completion_length:
            # One turn: every token's return is G_0, its advantage the row's.
            values.extend([advantages[b]] * ep.completion_length)
            continue
        per_token = token_returns(rewards, ends, ep.completion_length, gamma)
        values.extend((advantages[b] + (per_token - first[b]) * scales[b]).tolist())
    out_B_T = torch.zeros((len(episodes), width))
    rows, cols = row_positions(
        [e.completion_length for e in episodes], [e.prompt_length - 1 for e in episodes]
    )
    out_B_T[rows, cols] = torch.tensor(values, dtype=torch.float32)
    return out_B_T


def turn_rewards_per_token(episodes: Sequence[Episode], mask_B_T: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` rewards for GAE: each turn's reward on the last model token of that turn."""
    rewards_B_T = torch.zeros_like(mask_B_T, dtype=torch.float32)
    for b, ep in enumerate(episodes):
        start = ep.prompt_length - 1
        rewards, ends = ep.turns()
        for reward, end in zip(rewards, ends, strict=True):
            on = torch.nonzero(mask_B_T[b, start : start + end] > 0)
            if len(on):  # a turn without model tokens has no token to credit
                rewards_B_T[b, start + int(on[-1])] += reward
    return rewards_B_T


def gae_token_advantages(
    episodes: Sequence[Episode],
    values_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    reward_shift_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: (whitened GAE advantages, returns) ``[B, T]``; reward_shift_B_T (a per-token KL
    penalty) is added to the per-token rewards."""
    rewards_B_T = turn_rewards_per_token(episodes, mask_B_T)
    if reward_shift_B_T is not None:
        rewards_B_T = rewards_B_T + reward_shift_B_T
    advantages_B_T, returns_B_T = gae_advantages(
        rewards_B_T, values_B_T, mask_B_T, gamma=gamma, lam=lam
    )
    on = mask_B_T > 0
    if int(on.sum()) > 1:
        mean, std = advantages_B_T[on].mean(), advantages_B_T[on].std(unbiased=False)
        advantages_B_T = torch.where(on, (advantages_B_T - mean) / (std + WHITEN_EPS), 0.0)
    return advantages_B_T, returns_B_T


def _shifted(ep: Episode, shift_B: torch.Tensor | None, b: int) -> Episode:
    if shift_B is None:
        return ep
    rewards, ends = ep.turns()
    moved = (*rewards[:-1], rewards[-1] + float(shift_B[b]))
    return replace(ep, turn_rewards=moved, turn_ends=ends)
