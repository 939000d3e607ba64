"""The critic's regression loss, with optional PPO-style value clipping.

    unclipped_bt = (V_bt - R_bt)^2
    clipped_bt   = (old_V_bt + clip(V_bt - old_V_bt, -c, c) - R_bt)^2
    loss = 0.5 * sum_bt w_bt * max(unclipped_bt, clipped_bt)      (c = None: unclipped only)

``V`` carries the gradient; ``old_V`` (the values before this batch's first update) and the
returns ``R`` are constants. Clipping keeps one batch from moving the critic far.
"""

from __future__ import annotations

import torch


def value_loss(
    values_B_T: torch.Tensor,
    old_values_B_T: torch.Tensor,
    returns_B_T: torch.Tensor,
    weights_B_T: torch.Tensor,
    *,
    clip_range: float | None = None,
) -> torch.Tensor:
    """The weighted squared error (see the module doc); weights are 0 off the mask."""
    returns_B_T = returns_B_T.detach()
    squared_B_T = (values_B_T - returns_B_T) ** 2
    if clip_range is not None:
        old_B_T = old_values_B_T.detach()
        moved_B_T = old_B_T + torch.clamp(values_B_T - old_B_T, -clip_range, clip_range)
        squared_B_T = torch.maximum(squared_B_T, (moved_B_T - returns_B_T) ** 2)
    on_B_T = weights_B_T > 0
    return 0.5 * (torch.where(on_B_T, squared_B_T, 0.0) * weights_B_T.to(values_B_T.dtype)).sum()


def explained_variance(
    values_B_T: torch.Tensor, returns_B_T: torch.Tensor, mask_B_T: torch.Tensor
) -> float:
    """``1 - Var(R - V) / Var(R)`` over masked tokens: 1 = perfect critic, 0 = no better than a
    constant, negative = worse. 0 when the returns do not vary."""
    on = mask_B_T > 0
    returns, values = returns_B_T[on].float(), values_B_T[on].float()
    if returns.numel() < 2:
        return 0.0
    variance = returns.var(unbiased=False)
    if variance <= 0:
        return 0.0
    return float(1.0 - (returns - values).var(unbiased=False) / variance)
