"""Metric sinks read back by their own tools: TensorBoard's EventAccumulator, W&B's offline
run folder, and json for the jsonl file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from opentinker.jobs import JobEvent
from opentinker.sinks import JsonlSink, TensorBoardSink, WandbSink, close_all, write_all

pytestmark = pytest.mark.unit


def run_events() -> list[JobEvent]:
    """A short run as WatchJob reports it: RUNNING, three steps, SUCCEEDED."""
    steps = [
        JobEvent(seq=2 + i, time_unix_s=1000.0 + i, kind="step", step=i + 1, policy_version=i + 1,
                 metrics={"reward_mean": r, "loss": 0.5 - 0.1 * i, "time_train_s": 0.2})
        for i, r in enumerate((0.25, 0.5, 0.75))
    ]  # fmt: skip
    return [
        JobEvent(seq=1, time_unix_s=999.0, kind="state", state="RUNNING"),
        *steps,
        JobEvent(seq=5, time_unix_s=1003.0, kind="state", state="SUCCEEDED"),
    ]


def test_jsonl_sink_keeps_every_event_in_order(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "run.jsonl")
    for event in run_events():
        sink.write(event)
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["seq"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["metrics"]["reward_mean"] for r in rows if r["kind"] == "step"] == [0.25, 0.5, 0.75]


def test_tensorboard_reader_finds_the_reward_scalar(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = [TensorBoardSink(tmp_path / "tb")]
    for event in run_events():
        write_all(sinks, event)
    close_all(sinks)

    reader = EventAccumulator(str(tmp_path / "tb"))
    reader.Reload()
    assert {"reward_mean", "loss", "time_train_s"} <= set(reader.Tags()["scalars"])
    rewards = reader.Scalars("reward_mean")
    assert [(s.step, s.value) for s in rewards] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert rewards[0].wall_time == 1000.0  # the step's own time, not when it was written


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    sink = WandbSink(project="opentinker-test", name="letters", directory=tmp_path)
    for event in run_events():
        sink.write(event)
    run_dir = sink.run_dir
    sink.close()

    assert run_dir.name.startswith("offline-run-"), run_dir
    (log,) = run_dir.glob("run-*.wandb")  # what `wandb sync` uploads later
    # wandb ships no reader for its offline log; its history records hold each metric's name
    # and value as JSON text, so the last reward is there verbatim.
    deadline = time.monotonic() + 20  # wandb's service process writes it after finish()
    while b"0.75" not in (records := log.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"reward_mean" in records and b"0.75" in records and b"time_train_s" in records


def test_the_sdk_and_its_sinks_import_without_the_optional_packages() -> None:
    """Importing the CLI and the sinks module pulls in none of torch, TensorBoard, W&B or
    matplotlib: each is imported when a sink or a plot is made."""
    import subprocess
    import sys

    code = (
        "import sys, opentinker, opentinker.cli, opentinker.sinks, opentinker.live_view;"
        "print(sorted(m for m in ('torch', 'tensorboard', 'wandb', 'matplotlib') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
