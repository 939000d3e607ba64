"""The RL loop's watch on env trouble: a line for the job's event stream for each step that
had env errors (with the first reason), the verdict of RlConfig.max_env_error_fraction over
the last env_error_window steps (common/env_errors.py), and GRPO groups whose members got
different prompts (an env that ignores its seed: the group's advantages then compare answers
to different questions), counted every step and told once per job."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentinker.services.common.env_errors import EnvErrorWindow, env_error_line
from opentinker.services.trainer.rl.agent_segments import first_rows
from opentinker.services.trainer.rl.batch import CollectedBatch, Episode
from opentinker.services.trainer.rl.step_metrics import batch_env_errors
from opentinker.spec import RlConfig


@dataclass(frozen=True)
class EnvErrorNews:
    """What one step's env errors mean: ``line`` for the event stream ('' = none failed),
    ``failure``: why the job must fail ('' = it goes on)."""

    line: str
    failure: str
    metrics: dict[str, float] = field(default_factory=dict)  # groups_prompt_mismatch
    warning: str = ""  # the first step with mixed-prompt groups
    reason: str = ""  # the step's first env error (StepMetrics.env_error_reason); '' = none


class EnvErrorWatch:
    def __init__(self, rl: RlConfig) -> None:
        self._env_name, self._steps = rl.env_name, rl.steps
        self._told_mixed_prompts = False
        self._window = EnvErrorWindow(
            env_name=rl.env_name,
            max_fraction=rl.max_env_error_fraction,
            window=rl.env_error_window,
        )

    def observe(self, batch: CollectedBatch, step: int) -> EnvErrorNews:
        """Step ``step`` (1-based, done) played ``batch``."""
        t = batch_env_errors(batch)
        line = env_error_line(self._env_name, f"in step {step}", t) if t.errors else ""
        mixed = mixed_prompt_groups([e for e in batch.episodes if not e.env_error])
        warning = ""
        if mixed and not self._told_mixed_prompts:
            self._told_mixed_prompts = True
            warning = (
                f"env '{self._env_name}': {len(mixed)} GRPO group(s) of step {step} got "
                f"different prompts (groups {mixed[:5]}); the env seems to ignore the seed "
                "Reset gives it, so a group's advantages compare answers to different "
                "questions: make Reset depend on its seed only"
            )
        return EnvErrorNews(
            line,
            self._window.add(t, final=step >= self._steps),
            {"groups_prompt_mismatch": float(len(mixed))},
            warning,
            t.first_reason,
        )


def mixed_prompt_groups(episodes: Sequence[Episode]) -> list[int]:
    """The group indices (sorted) whose episodes do not all begin with the same prompt
    tokens (per role in a multi-agent env, where each role has its own view; an agent
    episode's first segment)."""
    prompts: dict[tuple[int, str], set[tuple[int, ...]]] = defaultdict(set)
    for e in (episodes[i] for i in first_rows(episodes)):  # a later segment re-renders
        prompts[(e.group_index, e.role)].add(tuple(e.token_ids[: e.prompt_length]))
    return sorted({group for (group, _), seen in prompts.items() if len(seen) > 1})
