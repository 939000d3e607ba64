"""Per-role figures of multi-agent self-play (names are part of the event stream's contract).

Training steps: ``role/<role>/reward_mean`` over that role's trajectories of the batch.
Validation (every ``val_every`` steps): ``role/<role>/win_rate_vs_<opponent>``, the share of a
role's validation games it won, over the games where the env itself played the other side
(the env's ``info["opponent"]``, e.g. ``heuristic`` for ``gomoku_selfplay`` with
``val_env_options={"heuristic_plays": "alternate"}``; ``info["winner"]`` names the winner).
Validation games are fixed and never trained on, so the figure is comparable across steps.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from opentinker.services.trainer.rl.batch import Episode


def role_reward_means(episodes: Sequence[Episode]) -> dict[str, float]:
    """``role/<role>/reward_mean`` of a training batch (none without roles)."""
    rewards: dict[str, list[float]] = defaultdict(list)
    for ep in episodes:
        if ep.role:
            rewards[ep.role].append(ep.reward)
    return {f"role/{role}/reward_mean": sum(r) / len(r) for role, r in sorted(rewards.items())}


def role_win_rates(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``role/<role>/win_rate_vs_<opponent>`` of validation rows (each with ``role`` and the
    env's ``info``); rows without a role or an opponent are not counted."""
    games: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        info = row.get("info", {})
        role, opponent = row.get("role", ""), info.get("opponent", "")
        if role and opponent and row.get("finish_reason") != "ENV_ERROR":
            games[f"role/{role}/win_rate_vs_{opponent}"].append(info.get("winner") == role)
    return {name: sum(won) / len(won) for name, won in sorted(games.items())}
