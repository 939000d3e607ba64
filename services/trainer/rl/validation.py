"""Validation during RL: every ``val_every`` steps (and after the last) the policy plays a
fixed set of evaluation episodes, never trained on, and the step's metrics gain ``val/*``.

The episodes come from the rollout's evaluation stream (seeds disjoint from training's; env
options merged with ``val_env_options``, e.g. a dataset env's validation split), the same
``val_episodes`` episodes each time so the figures are comparable across steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import structlog

from opentinker.inference_rows import summarize
from opentinker.services.trainer.rl.role_metrics import role_win_rates
from opentinker.spec import RlConfig

log = structlog.get_logger()


class EvalRollout(Protocol):
    async def evaluate(
        self,
        *,
        batch_index: int,
        first_episode: int,
        episodes: int,
        temperature: float,
        timeout_s: float,
        samples: int = 1,
    ) -> list[dict[str, Any]]: ...


def validation_metrics(rows: Sequence[dict[str, Any]], *, seconds: float) -> dict[str, float]:
    """The ``val/*`` figures of evaluation rows (reward_mean, accuracy = fraction with
    reward > 0, turns_mean, env_errors, episodes) and the seconds they took."""
    s = summarize(rows)
    return {
        "val/reward_mean": s.mean_reward,
        "val/accuracy": s.accuracy,
        "val/turns_mean": s.mean_turns,
        "val/env_errors": float(s.env_errors),
        "val/episodes": float(s.episodes),
        "val/time_s": seconds,
        **role_win_rates(rows),  # multi-agent self-play against the env's own player
    }


class Validation:
    """When to validate, and the figures of the last validation (one per step at most)."""

    def __init__(self, rl: RlConfig, *, timeout_s: float) -> None:
        self.rl = rl
        self.timeout_s = timeout_s
        self._last: tuple[int, dict[str, float]] | None = None

    @property
    def enabled(self) -> bool:
        return self.rl.val_every > 0

    def due(self, step: int) -> bool:
        """After every val_every-th step and after the last step."""
        return self.enabled and (step % self.rl.val_every == 0 or step >= self.rl.steps)

    async def run(self, rollout: EvalRollout, step: int) -> dict[str, float]:
        """Validate the policy the rollout serves now (after ``step``); val/* metrics."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        started = time.monotonic()
        rows = await rollout.evaluate(
            batch_index=step,
            first_episode=self.rl.val_first_episode,
            episodes=self.rl.val_episodes,
            temperature=self.rl.val_temperature,
            timeout_s=self.timeout_s,
        )
        metrics = validation_metrics(rows, seconds=time.monotonic() - started)
        self._last = (step, metrics)
        log.info("validated", step=step, **{k: round(v, 4) for k, v in metrics.items()})
        return metrics
