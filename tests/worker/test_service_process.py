"""The local mesh's service processes never outlive the launcher that started them: a launcher
(``opentinker up``, ``demo``, a test run) killed by SIGKILL, SIGHUP (its terminal closed) or a
crash runs no clean-up, and a service left behind keeps its port (the next ``up`` fails on
50051) and its CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# A launcher that starts the real scheduler as the mesh does, says its pid once it serves,
# and waits to be killed.
LAUNCHER = """
import json, sys, time
from pathlib import Path
from opentinker.services.common.launch import wait_for_file
from opentinker.services.launcher.processes import ServiceProcess

env, folder = json.loads(sys.argv[1]), Path(sys.argv[2])
proc = ServiceProcess.start("scheduler", "opentinker.services.scheduler", env=env,
                            log_dir=folder / "logs")
wait_for_file(folder / "scheduler.addr", timeout_s=60, alive=proc.alive)
print(proc.process.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_service_stops_when_its_launcher_is_killed(redis_url: str, tmp_path: Path) -> None:
    env = {
        "OPENTINKER_REDIS_URL": redis_url,
        "OPENTINKER_PORT": "0",
        "OPENTINKER_ADDRESS_FILE": str(tmp_path / "scheduler.addr"),
        "OPENTINKER_AUTH_SECRET_FILE": str(tmp_path / "auth.secret"),
        "OPENTINKER_BOOTSTRAP_DIR": str(tmp_path),
    }
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, json.dumps(env), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    service_pid = 0
    try:
        assert launcher.stdout is not None
        service_pid = int(launcher.stdout.readline())
        assert _running(service_pid)
        launcher.kill()  # no clean-up of its own runs
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 30
        while _running(service_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(service_pid), "the scheduler outlived its launcher"
    finally:
        launcher.kill()
        if service_pid and _running(service_pid):
            os.kill(service_pid, signal.SIGKILL)


def test_a_service_that_does_not_stop_leaves_the_rest_of_the_mesh_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LocalMesh.stop went no further than a service whose stop raised (a process stuck in the
    kernel outlives SIGKILL's wait; none can be made here, so that one stop is made to raise):
    every service after it and Redis kept running."""
    from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

    mesh = LocalMesh(MeshSettings(run_root=tmp_path / "mesh", warm_spares=0)).__enter__()
    stuck = next(p for p in mesh.processes if p.name == "envhub")
    others = [p for p in mesh.processes if p is not stuck]
    redis_pid = mesh.redis.pid if mesh.redis is not None else None

    def refuses(**_: object) -> None:
        raise subprocess.TimeoutExpired("envhub", 5)

    monkeypatch.setattr(stuck, "stop", refuses)
    try:
        with pytest.raises(RuntimeError, match=r"but for: envhub"):
            mesh.stop()
        assert others and not any(p.alive() for p in others)
        assert redis_pid and not _running(redis_pid)
    finally:
        os.killpg(stuck.process.pid, signal.SIGKILL)
        stuck.process.wait(timeout=10)
