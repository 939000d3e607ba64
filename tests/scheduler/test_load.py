"""The load benchmark, small: many jobs from concurrent clients of 3 tenants, some retried and
some cancelled, through a real scheduler and Redis; nothing lost, duplicated or over quota."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fault_report import record_load

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BENCH = Path(__file__).resolve().parents[2] / "bench" / "load.py"


def test_small_load_loses_nothing_and_keeps_every_quota() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--jobs", "150", "--clients", "6", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("SUMMARY "))
    summary = json.loads(line.removeprefix("SUMMARY "))
    assert summary["jobs"] == 150
    assert sum(summary["states"].values()) == 150
    assert set(summary["states"]) <= {"SUCCEEDED", "CANCELLED"}
    assert (summary["lost"], summary["unknown"], summary["ran_twice"]) == (0, 0, 0)
    assert summary["double_leases"] == 0  # from the ledger's own history
    assert summary["quota_samples"] >= 10 and summary["quota_violations"] == 0  # sampled all along
    assert summary["retries_same_job"] == summary["retried_submits"]
    assert set(summary["start_p50_s"]) == {"alpha", "beta", "gamma"}  # every tenant got devices
    record_load(
        jobs=summary["jobs"],
        jobs_per_s=summary["jobs_per_s"],
        submit_p99_ms=summary["submit_p99_ms"],
        lost=summary["lost"],
        duplicated=summary["unknown"],
        double=summary["double_leases"],
        violations=summary["quota_violations"],
    )
