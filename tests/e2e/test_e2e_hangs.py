"""Hangs survived, end to end: a trainer or a rollout that stops answering in the middle of an RL
job (SIGSTOP, as a frozen GPU call or host would) is a lost attempt, not a failed job. Its peer
notices (the rollout: its trainer's stream cut by keepalive; the trainer: its rollout's), the
worker kills the hung process and the job is re-queued, resumes from its last checkpoint and
ends SUCCEEDED, the re-queue saying which process stopped answering.

The real mesh as processes, with short bounds (the rollout pings its trainer every 2 s, the
worker waits 2 s for a health answer or a lost trainer's own exit); the attempt must be ended
well before a 60 s stop would end by itself (the trainer notices a hung rollout by its channel's
keepalive: a ping every 10 s, answered within 5)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_report import record_fault
from ledger_helpers import assert_no_double_lease
from test_e2e_faults import assert_resumed, assert_takes_new_jobs, job, run_and_kill

from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHORT_BOUNDS = {
    "OPENTINKER_ROLLOUT_TRAINER_KEEPALIVE_S": "2",  # a silent trainer is cut after 2 + 1 s
    "OPENTINKER_LIVENESS_TIMEOUT_S": "2",  # the worker's health check of the rollout
    "OPENTINKER_PEER_LOST_GRACE_S": "2",  # a lost trainer's time to exit by itself
}
DETECTED_WITHIN_S = 45.0  # from the SIGSTOP to the re-queue
STOPPED_FOR_S = 60.0  # then SIGCONT, as the trial did: by then the attempt must be over


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    with pytest.MonkeyPatch.context() as env:
        for name, value in SHORT_BOUNDS.items():
            env.setenv(name, value)  # the worker and the job processes it starts inherit them
        settings = MeshSettings(run_root=tmp_path_factory.mktemp("hangs"), warm_spares=0)
        with LocalMesh(settings) as running:
            yield running


def stop_process(mesh: LocalMesh, job_id: str, name: str, stopped: dict[int, float]) -> None:
    """SIGSTOP attempt 1's ``name`` process (it hangs: it runs no more, answers nothing) for
    STOPPED_FOR_S, unless the worker killed it first."""
    pid = int((mesh.run_root / "jobs" / job_id / "attempt-1" / f"{name}.pid").read_text())
    assert f"opentinker.services.{name}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    os.kill(pid, signal.SIGSTOP)
    stopped[pid] = time.time()
    resume = threading.Timer(STOPPED_FOR_S, signal_if_alive, args=(pid, signal.SIGCONT))
    resume.daemon = True
    resume.start()


def signal_if_alive(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def gone(pid: int) -> bool:
    """The process no longer exists (killed and reaped by the worker)."""
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize(
    ("name", "lost"),
    [
        ("trainer", "trainer process stopped answering its rollout"),
        ("rollout", "rollout process stopped answering (no health check answer within 2 s)"),
    ],
)
def test_a_hung_process_is_killed_and_its_job_resumes(
    mesh: LocalMesh, letter_model_dir: Path, name: str, lost: str
) -> None:
    stopped: dict[int, float] = {}
    try:
        final, events, killed_at = run_and_kill(
            mesh, job(letter_model_dir), lambda job_id: stop_process(mesh, job_id, name, stopped)
        )
        assert_resumed(final, events, killed_at, lost)
        ((pid, stopped_at),) = stopped.items()
        assert gone(pid), f"the hung {name} was left running"
        requeued = next(e for e in events if e.reason.endswith("; re-queued"))
        detected_s = requeued.time_unix_s - stopped_at
        assert 0 < detected_s < DETECTED_WITHIN_S, detected_s
    finally:
        for pid in stopped:  # a test that failed leaves no stopped process behind
            signal_if_alive(pid, signal.SIGKILL)
    # the user's job is not blamed: no event of the job says it failed
    assert not [e for e in events if e.kind == "state" and e.state == "FAILED"]
    assert_no_double_lease(mesh.redis_url, final.job_id, attempts=2)
    assert_takes_new_jobs(mesh, letter_model_dir)
    record_fault(
        f"{name} hang",
        f"killed by the worker {detected_s:.1f} s after SIGSTOP; resumed from its checkpoint",
    )
