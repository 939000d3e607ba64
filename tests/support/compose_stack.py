"""The real compose stack for tests/project/test_compose_stack.py: an engine that can start, the
local base image, one build, and the compose commands the test runs against it.

``engine_problem()`` says why no stack can run here (no ``docker`` command, no engine, no
compose v2, no debootstrap), or None; the test then skips with that sentence. Everything runs
under one compose project of its own, with only the scheduler published, on a free port of the
host's loopback (several test runs on one machine do not collide with each other or with
a stack a person runs).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TORCH = "torch==2.13.0+cpu"  # .ci/constraints.txt's torch, the CPU build pip finds here

IMAGE = "opentinker-compose-test:latest"  # not a person's opentinker:latest

# The test's own override: local images instead of a registry's, and no fixed host ports.
OVERRIDE = """\
services:
  redis:
    image: {base}
    pull_policy: never
    working_dir: /data
    # compose.yaml's command, with protected mode off as the redis image has it (Debian's
    # redis-server keeps it on, refusing every client but the container's own loopback)
    command: {redis_command}
  scheduler:
    image: {image}
    build:
      args:
        BASE_IMAGE: {base}
    ports: !override
      - "127.0.0.1:{port}:50051"
  envhub:
    image: {image}
    ports: !reset []
  dashboard:
    image: {image}
    ports: !reset []
  tinker-gateway:
    image: {image}
    ports: !reset []
  worker:
    image: {image}
    environment:
      OPENTINKER_NUM_CPU_SLOTS: "1"
      OPENTINKER_WARM_SPARES: "0"
"""


def _run(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def override(base: str, port: int) -> str:
    """The test's override for a base image and a host port of the scheduler's."""
    redis = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["redis"]
    command = json.dumps([*redis["command"], "--protected-mode", "no"])
    return OVERRIDE.format(base=base, image=IMAGE, port=port, redis_command=command)


def free_port() -> int:
    """A port free on the host's loopback now (the scheduler's, kept across its restarts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def engine_problem() -> str | None:
    """Why a compose stack cannot run on this machine, or None when it can."""
    if shutil.which("docker") is None:
        return "no `docker` command (CI installs Debian's docker.io: .ci/run)"
    try:
        info = _run(["docker", "info", "--format", "{{.ServerVersion}}"], 30)
        if info.returncode != 0:
            return f"no container engine answers: {info.stderr.strip()[:300]}"
        compose = _run(["docker", "compose", "version", "--short"], 30)
    except subprocess.TimeoutExpired as err:
        return f"the container engine did not answer in time: {err}"
    if compose.returncode != 0 or not compose.stdout.strip().startswith("2"):
        return f"no compose v2 plugin (`docker compose version`: {compose.stderr.strip()[:200]})"
    if shutil.which("debootstrap") is None:
        return "no debootstrap to make the base image from Debian's packages"
    return None


def local_base_image(timeout: float) -> str:
    """The Debian base image (deploy/local_images.sh), made once per version of that script."""
    made = _run(["bash", str(DEPLOY / "local_images.sh")], timeout)
    if made.returncode != 0:
        raise RuntimeError(f"deploy/local_images.sh failed: {made.stderr.strip()[-800:]}")
    return made.stdout.strip().splitlines()[-1]


def local_torch_wheel(timeout: float) -> bool:
    """Put the CPU torch wheel into deploy/wheels/ (the image's pip finds it there), taken as
    `make install` takes it: with this machine's pip configuration. False when pip finds none."""
    wheels = DEPLOY / "wheels"
    if list(wheels.glob("torch-2.13.0+cpu-*.whl")):
        return True
    got = _run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "-d", str(wheels), TORCH],
        timeout,
    )  # fmt: skip
    return got.returncode == 0 and bool(list(wheels.glob("torch-2.13.0+cpu-*.whl")))


@dataclass
class Stack:
    """One compose project: deploy/compose.yaml + compose.cpu.yaml + the test's override."""

    project: str
    override: Path
    env: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 180, check: bool = True) -> str:
        argv = ["docker", "compose", "-p", self.project, "-f", str(DEPLOY / "compose.yaml")]
        argv += ["-f", str(DEPLOY / "compose.cpu.yaml"), "-f", str(self.override), *args]
        done = _run(argv, timeout, env={**os.environ, **self.env})
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def timed(self, label: str, *args: str, timeout: float = 180) -> str:
        start = time.monotonic()
        out = self.compose(*args, timeout=timeout)
        self.timings[label] = round(time.monotonic() - start, 1)
        return out

    def exec(self, service: str, *cmd: str, user: str | None = None, timeout: float = 120) -> str:
        as_user = ["--user", user] if user else []
        return self.compose("exec", "-T", *as_user, service, *cmd, timeout=timeout)

    def scheduler_address(self) -> str:
        return self.compose("port", "scheduler", "50051").strip()

    def image_size_mb(self, image: str = IMAGE) -> float:
        out = _run(["docker", "image", "inspect", image], 30).stdout
        return round(json.loads(out)[0]["Size"] / 1e6, 1)
