"""What the CLI draws: the reward sparkline, the ETA, a jobs table that fits, the curves PNG."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from opentinker.console import format_event, jobs_table
from opentinker.jobs import RL_FINAL_REWARD, JobEvent, JobInfo
from opentinker.live_view import TailView, eta_seconds, sparkline
from opentinker.plot import plot_curves

pytestmark = pytest.mark.unit


def test_sparkline_scales_between_min_and_max() -> None:
    # 8 blocks, span 0..1: 0 -> ▁ (index 0), 0.5 -> round(3.5) = 4 -> ▅, 1 -> █ (index 7)
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([0.3, 0.3]) == "▁▁"  # a flat line does not divide by zero
    assert sparkline([]) == ""


def test_a_nan_or_infinite_reward_is_a_gap_not_a_crash_of_tail() -> None:
    """A step whose reward_mean is NaN (no episode scored) or inf used to raise in round()
    and end `opentinker tail` mid-run."""
    nan, inf = float("nan"), float("inf")
    assert sparkline([0.0, nan, 1.0, inf, -inf]) == "▁ █  "
    assert sparkline([nan]) == " "
    view = TailView(job_id="job-1", step_budget=4)
    for step, reward in enumerate([0.5, nan, 1.0], start=1):
        view.update(JobEvent(seq=step, time_unix_s=float(step), kind="step", step=step,
                             metrics={"reward_mean": reward}))  # fmt: skip
    console = Console(width=100, record=True, color_system=None)
    console.print(view.render())
    assert "▁ █ 1.000 (min 0.500, max 1.000)" in console.export_text()


def test_eta_from_the_recent_pace() -> None:
    # steps 10 -> 20 took 50 s: 5 s a step; 80 steps left to 100 -> 400 s
    assert eta_seconds([(10, 1000.0), (15, 1020.0), (20, 1050.0)], 100) == 400.0
    assert eta_seconds([(10, 1000.0)], 100) is None  # no pace yet
    assert eta_seconds([(10, 1000.0), (20, 1050.0)], 0) is None  # no budget


def test_tail_view_draws_progress_eta_and_rewards() -> None:
    view = TailView(job_id="job-1", step_budget=10)
    view.update(JobEvent(seq=1, time_unix_s=0.0, kind="state", state="RUNNING"))
    for step in range(1, 5):
        metrics = {"reward_mean": step / 4}
        view.update(JobEvent(seq=1 + step, time_unix_s=2.0 * step, kind="step", step=step,
                             metrics=metrics))  # fmt: skip
    console = Console(width=100, record=True, color_system=None)
    console.print(view.render())
    text = console.export_text()
    # 2 s a step, 6 steps left -> 12 s
    assert "step 4/10" in text and "ETA 0:00:12" in text and "RUNNING" in text
    assert "▁▃▆█" in text and "1.000" in text  # rewards 0.25..1.0 scaled: 0, 2.33, 4.67, 7


def job(i: int) -> JobInfo:
    return JobInfo(
        job_id=f"job-{i:04d}", name="a-rather-long-job-name-that-goes-on-and-on", state="FAILED",
        reason="the trainer ran out of memory on step 12 " * 4, attempt=2, worker_id="w",
        checkpoint_uri="", created_unix_s=1.7e9, updated_unix_s=1.7e9, kind="RL",
        step_budget=30, final_metrics={RL_FINAL_REWARD: 0.5},
    )  # fmt: skip


@pytest.mark.parametrize("width", [80, 120])
def test_jobs_table_fits_the_terminal(width: int) -> None:
    console = Console(width=width, record=True, color_system=None)
    console.print(jobs_table([job(1), job(2)], width=width))
    lines = console.export_text().splitlines()
    assert all(len(line) <= width for line in lines)
    rows = [line for line in lines if "job-000" in line]
    assert len(rows) == 2, lines  # one line per job, nothing wrapped
    assert all("FAILED" in r and "0.500" in r for r in rows)


def test_plot_writes_a_png_of_the_curves(tmp_path: Path) -> None:
    steps = [
        JobEvent(seq=i, time_unix_s=float(i), kind="step", step=i,
                 metrics={"reward_mean": i / 10, "loss": 1 / i, "entropy": 2.0, "kl": 0.01 * i,
                          "time_generate_s": 0.3, "time_train_s": 0.5})
        for i in range(1, 11)
    ]  # fmt: skip
    path = plot_curves(steps, tmp_path / "curves.png", title="job-1")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_step_line_shows_the_trainers_gpu_memory_peak_when_there_is_one() -> None:
    def line(metrics: dict[str, float]) -> str:
        event = JobEvent(seq=1, time_unix_s=0.0, kind="step", step=3, policy_version=3)
        event.metrics.update(metrics)
        return format_event(event)

    on_gpu = line({"reward_mean": 0.5, "memory_allocated_peak_gib": 12.34})
    assert on_gpu.endswith("reward 0.500  gpu mem 12.3 GiB"), on_gpu
    assert "mem" not in line({"reward_mean": 0.5, "memory_resident_gib": 0.4})  # on CPU: not


def test_the_jobs_table_shows_the_reward_each_kind_reports() -> None:
    """`opentinker jobs` read final_metrics["reward_mean"], which no job writes: an RL job's
    reward column was always "—"."""
    rl = job(1)
    inference = JobInfo(**{**rl.__dict__, "job_id": "job-0002", "kind": "INFERENCE",
                           "final_metrics": {"mean_reward": 0.25, "episodes": 8.0}})  # fmt: skip
    sft = JobInfo(**{**rl.__dict__, "job_id": "job-0003", "kind": "SFT",
                     "final_metrics": {"loss": 1.5}})  # fmt: skip
    assert (rl.final_reward, inference.final_reward, sft.final_reward) == (0.5, 0.25, None)
    console = Console(width=160, record=True, color_system=None)
    console.print(jobs_table([rl, inference, sft], width=160))
    lines = console.export_text().splitlines()
    rows = {line.split()[1]: line for line in lines if "job-0" in line}
    assert "0.500" in rows["job-0001"] and "0.250" in rows["job-0002"]
    assert "—" in rows["job-0003"]
