"""The live footer of ``opentinker tail``: a progress bar to the step budget with an ETA, and
a sparkline of the recent rewards, redrawn as each step lands (rich ``Live``)."""

from __future__ import annotations

import datetime as dt
import math
from collections import deque

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from opentinker.jobs import JobEvent

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

    def __init__(self, *, job_id: str, step_budget: int, window: int = 60) -> None:
        self.job_id, self.step_budget = job_id, step_budget
        self.state = ""
        self.step = 0
        self.rewards: deque[float] = deque(maxlen=window)
        self.step_times: deque[tuple[int, float]] = deque(maxlen=window)

    def update(self, event: JobEvent) -> None:
        if event.kind == "state":
            self.state = event.state
        elif event.kind == "step":
            self.step = event.step
            self.step_times.append((event.step, event.time_unix_s))
            if "reward_mean" in event.metrics:
                self.rewards.append(event.metrics["reward_mean"])

    def render(self) -> RenderableType:
        line = Table.grid(padding=(0, 1))
        budget = self.step_budget
        done = f"step {self.step}/{budget}" if budget else f"step {self.step}"
        eta = eta_seconds(list(self.step_times), budget)
        eta_text = f"ETA {dt.timedelta(seconds=round(eta))}" if eta is not None else "ETA —"
        bar = ProgressBar(total=budget or None, completed=self.step, width=30)
        line.add_row(Text(f"{self.job_id} {self.state}", style="bold"), bar, done, eta_text)
        rewards = list(self.rewards)
        finite = [r for r in rewards if math.isfinite(r)]
        spark = Text("reward ")
        if finite:
            spark.append(sparkline(rewards), style="green")
            spark.append(f" {finite[-1]:.3f} (min {min(finite):.3f}, max {max(finite):.3f})")
        return Group(line, spark)
