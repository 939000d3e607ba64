"""Generalized Advantage Estimation (Schulman et al., 2016) over the model's own tokens.

Time steps are the positions where ``mask_B_T`` is 1 (tokens the policy generated); the rest
(prompt, environment observations, padding) are skipped, as if the model's tokens stood next to
each other. After a sequence's last model token the episode ends: the next value is 0.

    delta_t = r_t + gamma * V_next - V_t
    A_t     = delta_t + gamma * lambda * A_next
    R_t     = A_t + V_t        (the critic's regression target)

Rewards at unmasked positions are ignored: put each reward on a model token (the last one of
its turn).
"""

from __future__ import annotations

import torch


def gae_advantages(
    rewards_B_T: torch.Tensor,
    values_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``[B, T]`` (0 where the mask is 0); inputs are constants."""
    if not rewards_B_T.shape == values_B_T.shape == mask_B_T.shape:
        raise ValueError(
            f"shape mismatch: rewards {tuple(rewards_B_T.shape)}, values "
            f"{tuple(values_B_T.shape)}, mask {tuple(mask_B_T.shape)}"
        )
    rewards_B_T = rewards_B_T.detach().to(torch.float32)
    values_B_T = values_B_T.detach().to(torch.float32)
    on_B_T = mask_B_T > 0
    advantages_B_T = torch.zeros_like(rewards_B_T)
    next_value_B = torch.zeros(rewards_B_T.shape[0])
    next_advantage_B = torch.zeros(rewards_B_T.shape[0])
    for t in range(rewards_B_T.shape[1] - 1, -1, -1):
        delta_B = rewards_B_T[:, t] + gamma * next_value_B - values_B_T[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        on_B = on_B_T[:, t]
        advantages_B_T[:, t] = torch.where(on_B, advantage_B, 0.0)
        next_value_B = torch.where(on_B, values_B_T[:, t], next_value_B)
        next_advantage_B = torch.where(on_B, advantage_B, next_advantage_B)
    returns_B_T = torch.where(on_B_T, advantages_B_T + values_B_T, 0.0)
    return advantages_B_T, returns_B_T
