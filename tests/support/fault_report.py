"""What the fault and load tests proved, printed at the end of the test run.

Each fault test records its fault once everything it asserts has held (the job SUCCEEDED, no
step went back past the last checkpoint, no double lease in the ledger's history, the mesh took
a new job); a fault whose test failed or did not run is counted as not survived. The load test
records its figures. ``pytest_terminal_summary`` in conftest.py prints the table.
"""

from __future__ import annotations

FAULTS = (
    "worker agent",
    "trainer",
    "rollout",
    "scheduler",
    "EnvHub",
    "redis-server",
    "trainer hang",  # SIGSTOP: killed by the worker (test_e2e_hangs.py)
    "rollout hang",
)

survived: dict[str, str] = {}  # fault -> what the test checked
load_figures: dict[str, float] = {}


def record_fault(fault: str, checked: str) -> None:
    assert fault in FAULTS, fault
    survived[fault] = checked


def record_load(**figures: float) -> None:
    load_figures.update(figures)


def summary_lines() -> list[str]:
    if not survived and not load_figures:
        return []
    lines = [f"faults survived (SIGKILL or SIGSTOP mid-job): {len(survived)} of {len(FAULTS)}"]
    for fault in FAULTS:
        lines.append(
            f"  {fault:<13} {'survived: ' + survived[fault] if fault in survived else '-'}"
        )
    if load_figures:
        lines.append(
            "load: {jobs:.0f} jobs, {jobs_per_s:.1f} jobs/s, submit p99 {submit_p99_ms:.1f} ms, "
            "lost {lost:.0f}, duplicated {duplicated:.0f}, double leases {double:.0f}, "
            "quota violations {violations:.0f}".format(**load_figures)
        )
    return lines
