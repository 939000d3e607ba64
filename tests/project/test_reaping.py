"""The worker's container reaps orphaned job grandchildren (issue 35): in deploy/compose.yaml
the worker runs under an init (``init: true``: Docker's docker-init, tini), not as PID 1; in
deploy/kubernetes its pod shares one process namespace, whose PID 1 is the pause container.

Checked here in a pid namespace of its own (``unshare --pid``), no container engine needed:
with a Python program as PID 1, as the agent was, an orphan stays a zombie; with docker-init
as PID 1 and the same program its child, it is reaped. (tests/project/test_compose_stack.py checks
the running worker container the same way where an engine runs.) Needs root, unshare and
docker-init (Debian's docker.io, or tini); elsewhere it skips, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from reaping import PROBE

pytestmark = pytest.mark.integration
COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose.yaml"

# PID 1 as the agent is: a Python program that starts children and waits only for its own.
AGENT_LIKE = "import subprocess, sys; print(subprocess.run([sys.executable, '-c', sys.argv[1]], capture_output=True, text=True).stdout.strip())"  # noqa: E501


def init_binary() -> str:
    return shutil.which("docker-init") or shutil.which("tini") or ""


def in_pid_namespace(*argv: str) -> str:
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture()
def can_unshare() -> None:
    problem = ""
    if os.geteuid() != 0:
        problem = "a pid namespace needs root"
    elif shutil.which("unshare") is None:
        problem = "no `unshare` (util-linux)"
    elif not init_binary():
        problem = "no docker-init or tini (Debian's docker.io or tini package)"
    if problem:
        print(f"skipped: {problem}")
        pytest.skip(problem)


def test_the_worker_container_runs_under_an_init() -> None:
    worker = yaml.safe_load(COMPOSE.read_text())["services"]["worker"]
    assert worker.get("init") is True, "worker: no `init: true`; orphans would stay zombies"


def test_the_kubernetes_worker_pod_has_a_reaper_as_pid_1() -> None:
    worker = yaml.safe_load((COMPOSE.parent / "kubernetes" / "worker.yaml").read_text())
    assert worker["kind"] == "DaemonSet"
    # the pause container is PID 1 of a pod sharing its process namespace, and reaps
    assert worker["spec"]["template"]["spec"].get("shareProcessNamespace") is True


def test_a_python_pid_1_leaves_zombies_and_an_init_reaps_them(can_unshare: None) -> None:
    assert in_pid_namespace(sys.executable, "-c", AGENT_LIKE, PROBE) == "zombie"
    assert in_pid_namespace(init_binary(), "--", sys.executable, "-c", AGENT_LIKE, PROBE) == (
        "reaped"
    )
