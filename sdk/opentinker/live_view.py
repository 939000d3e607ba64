"""The live footer of ``opentinker tail``: a progress bar to the step budget with an ETA, and
a sparkline of the recent rewards, redrawn as each step lands (rich ``Live``); the env errors
so far with the first reason. An inference job has no steps: its footer counts its episodes
done and failed."""

from __future__ import annotations

import datetime as dt
import math
import re
from collections import deque

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from opentinker.inference_rows import ENV_ERROR
from opentinker.jobs import JobEvent

# The trainer's line for a step's env errors (services/common/env_errors.env_error_line).
ENV_ERROR_LINE = re.compile(r"^env '[^']*': \d+ of \d+ episodes failed")

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """One block character per value, scaled between the finite values' min and max; a NaN
    or infinite value (a step that scored no episode) is a gap."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return " " * len(values)
    low, high = min(finite), max(finite)
    span = high - low or 1.0
    top = len(SPARK_BLOCKS) - 1
    return "".join(
        SPARK_BLOCKS[round((v - low) / span * top)] if math.isfinite(v) else " " for v in values
    )


def eta_seconds(step_times: list[tuple[int, float]], budget: int) -> float | None:
    """Seconds left to step ``budget`` at the pace of ``step_times`` ((step, unix s) pairs,
    oldest first); None without two steps to measure the pace or without a budget."""
    if budget <= 0 or len(step_times) < 2:
        return None
    (first_step, first_at), (last_step, last_at) = step_times[0], step_times[-1]
    if last_step <= first_step:
        return None
    per_step = (last_at - first_at) / (last_step - first_step)
    return max(budget - last_step, 0) * per_step


class TailView:
    """What the footer shows, updated from each event; ``render()`` draws it."""

    def __init__(self, *, job_id: str, step_budget: int, window: int = 60, kind: str = "") -> None:
        self.job_id, self.step_budget, self.kind = job_id, step_budget, kind
        self.state = ""
        self.step = 0
        self.rewards: deque[float] = deque(maxlen=window)
        self.step_times: deque[tuple[int, float]] = deque(maxlen=window)
        self.episodes = 0  # played (RL: every step's batch; inference: rows)
        self.env_errors = 0
        self.first_env_error = ""

    def update(self, event: JobEvent) -> None:
        if event.kind == "state":
            self.state = event.state
        elif event.kind == "step":
            self.step = event.step
            self.step_times.append((event.step, event.time_unix_s))
            if "reward_mean" in event.metrics:
                self.rewards.append(event.metrics["reward_mean"])
            errors = int(event.metrics.get("env_errors", 0))
            self.env_errors += errors
            self.first_env_error = self.first_env_error or event.env_error_reason
            self.episodes += int(event.metrics.get("episodes", 0)) + errors
        elif event.kind == "row":
            self.episodes += 1
            if event.row.get("finish_reason") == ENV_ERROR:
                self.env_errors += 1
                self.first_env_error = self.first_env_error or event.row.get("finish_detail", "")
        elif event.kind == "log" and ENV_ERROR_LINE.match(event.message):
            self.first_env_error = self.first_env_error or event.message

    def _env_error_text(self) -> Text:
        share = self.env_errors / self.episodes if self.episodes else 0.0
        text = Text(f"env errors {self.env_errors} ({share:.0%})", style="red")
        if self.first_env_error:
            text.append(f" — first: {self.first_env_error}")
        return text

    def render(self) -> RenderableType:
        if self.kind == "INFERENCE":  # no trainer, no steps: episodes done and failed
            line = Text(f"{self.job_id} {self.state}", style="bold")
            line.append(
                f"  episodes {self.episodes - self.env_errors} done / {self.env_errors} failed"
            )
            return Group(line, self._env_error_text()) if self.first_env_error else line
        row = Table.grid(padding=(0, 1))
        budget = self.step_budget
        done = f"step {self.step}/{budget}" if budget else f"step {self.step}"
        eta = eta_seconds(list(self.step_times), budget)
        eta_text = f"ETA {dt.timedelta(seconds=round(eta))}" if eta is not None else "ETA —"
        bar = ProgressBar(total=budget or None, completed=self.step, width=30)
        row.add_row(Text(f"{self.job_id} {self.state}", style="bold"), bar, done, eta_text)
        rewards = list(self.rewards)
        finite = [r for r in rewards if math.isfinite(r)]
        spark = Text("reward ")
        if finite:
            spark.append(sparkline(rewards), style="green")
            spark.append(f" {finite[-1]:.3f} (min {min(finite):.3f}, max {max(finite):.3f})")
        if self.env_errors:
            return Group(row, spark, self._env_error_text())
        return Group(row, spark)
