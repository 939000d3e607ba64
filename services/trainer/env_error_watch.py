"""The RL loop's watch on env errors: a line for the job's event stream for each step that
had some (with the first reason), and the verdict of RlConfig.max_env_error_fraction over
the last env_error_window steps (common/env_errors.py)."""

from __future__ import annotations

from dataclasses import dataclass

from opentinker.services.common.env_errors import EnvErrorWindow, env_error_line
from opentinker.spec import RlConfig

from .batch import CollectedBatch
from .step_metrics import batch_env_errors


@dataclass(frozen=True)
class EnvErrorNews:
    """What one step's env errors mean: ``line`` for the event stream ('' = none failed),
    ``failure``: why the job must fail ('' = it goes on)."""

    line: str
    failure: str


class EnvErrorWatch:
    def __init__(self, rl: RlConfig) -> None:
        self._env_name, self._steps = rl.env_name, rl.steps
        self._window = EnvErrorWindow(
            env_name=rl.env_name,
            max_fraction=rl.max_env_error_fraction,
            window=rl.env_error_window,
        )

    def observe(self, batch: CollectedBatch, step: int) -> EnvErrorNews:
        """Step ``step`` (1-based, done) played ``batch``."""
        t = batch_env_errors(batch)
        line = env_error_line(self._env_name, f"in step {step}", t) if t.errors else ""
        return EnvErrorNews(line, self._window.add(t, final=step >= self._steps))
