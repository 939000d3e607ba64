"""``opentinker demo`` ends, naming the service, when a service of its mesh exits: its job
would otherwise wait for a worker that is gone, and the demo (``make demo``, a CI step) with it,
with nothing on the screen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_the_demo_fails_naming_a_worker_that_exited(redis_url: str, tmp_path: Path) -> None:
    # A setting the worker alone reads and refuses: the worker exits as it starts.
    env = {**os.environ, "OPENTINKER_WARM_MODELS_MAX": "0"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "opentinker", "demo", "--run-root", str(tmp_path / "demo"),
             "--redis-url", redis_url, "--max-steps", "3"],
            env=env, capture_output=True, text=True, timeout=150,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the demo waited on for its lost worker: {err.stdout!r}")
    assert done.returncode == 1, done.stdout + done.stderr
    said = " ".join(done.stdout.split())  # as rich wrapped it
    assert "worker exited" in said and "worker.log" in done.stdout.replace("\n", ""), said
