"""Each job's processes under a uid of their own (issue 35: secrets by role).

A job's trainer and rollout run user-chosen models and env-facing code. Under the agent's own
uid they could read everything the agent can: its worker token, other jobs' folders (their job
tokens, logs, weights) and every tenant's checkpoints. A worker agent started as root (as in its
container) with ``OPENTINKER_JOB_UIDS='[first, count]'`` therefore runs each job's processes as
an unprivileged uid of that range, one per job running at once (its gid the same number, no
supplementary groups). The job's folders are handed to it (mode 0700; its checkpoint folder
0770 with the checkpoint root's group, so a gateway of that group lists and deletes them); the
agent's files stay the agent's. Warm spares and shared rollouts are started before any job is
known, so under the agent's uid: a worker with job uids uses neither.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from opentinker.errors import ConfigError

# Run by the job's first process (after supervisor's parent-death shim): drop to the job's uid,
# then ask again for SIGKILL at the agent's death, which the change of uid cleared (prctl(2)).
_DROP_SHIM = (
    "import ctypes, os, sys\n"
    "uid, gid, agent = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])\n"
    "os.setgroups([])\n"
    "os.setgid(gid)\n"
    "os.setuid(uid)\n"
    "os.umask(0o007)  # what it makes, its checkpoints' group (a gateway) may read and delete\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != agent:\n"
    "    sys.exit(70)  # the agent died before the shim ran\n"
    "os.execvp(sys.argv[4], sys.argv[4:])\n"
)
# Caches a job writes to: each uid gets a folder of its own under the configured one.
CACHE_VARIABLES = ("HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR")


@dataclass(frozen=True)
class JobUser:
    """The uid (and gid, the same number) one job's processes run as."""

    uid: int

    def command(self, argv: Iterable[str]) -> list[str]:
        """``argv`` run as this user (the agent must be root)."""
        shim = [sys.executable, "-I", "-S", "-c", _DROP_SHIM]
        return [*shim, str(self.uid), str(self.uid), str(os.getpid()), *argv]

    def env(self, env: dict[str, str], run_dir: Path) -> dict[str, str]:
        """The job's environment: its home is its run folder; its caches its own."""
        own = {"HOME": str(run_dir), "USER": f"job{self.uid}", "LOGNAME": f"job{self.uid}"}
        for name in CACHE_VARIABLES:
            if env.get(name):
                own[name] = str(self._mine(Path(env[name]) / f"uid-{self.uid}", 0o700))
        return {**env, **own}

    def hand_over(self, run_dir: Path, checkpoint_dir: Path) -> None:
        """The run folder (and its job folder) and the checkpoint folder become this user's,
        everything in them included: a resumed attempt may run under another uid."""
        job_dir = run_dir.parent
        for path in (job_dir, run_dir):
            self._mine(path, 0o700)
        self._chown_tree(run_dir, self.uid)
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        group = checkpoint_dir.parent.stat().st_gid  # the root's: a gateway of it may list them
        os.chown(checkpoint_dir, self.uid, group)
        checkpoint_dir.chmod(0o2770)
        self._chown_tree(checkpoint_dir, self.uid, group)

    def _mine(self, path: Path, mode: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, self.uid, self.uid)
        path.chmod(mode)
        return path

    @staticmethod
    def _chown_tree(root: Path, uid: int, gid: int | None = None) -> None:
        for folder, dirs, files in os.walk(root):
            for name in [*dirs, *files]:
                os.lchown(os.path.join(folder, name), uid, uid if gid is None else gid)


class JobUsers:
    """The agent's pool of job uids: ``first .. first + count - 1``, one per running job."""

    def __init__(self, first: int, count: int) -> None:
        if count and os.geteuid() != 0:
            raise ConfigError(
                "OPENTINKER_JOB_UIDS needs a worker agent started as root (it starts each job "
                "as one of those uids); unset it, or start the agent as root",
                reason="JOB_UIDS_NEED_ROOT",
            )
        self._free = list(range(first, first + count))
        self._taken: dict[tuple[str, int], int] = {}

    @property
    def enabled(self) -> bool:
        return bool(self._free or self._taken)

    def take(self, key: tuple[str, int]) -> JobUser | None:
        """A uid for the attempt ``key`` (job id, attempt); None when the pool is off. Every
        uid taken: ConfigError (more jobs at once than uids: the range is too small)."""
        if not self.enabled:
            return None
        if not self._free:
            raise ConfigError(
                f"all {len(self._taken)} job uids are in use: widen OPENTINKER_JOB_UIDS to at "
                "least the jobs this worker runs at once (its devices or CPU slots)",
                reason="JOB_UIDS_EXHAUSTED",
            )
        uid = self._free.pop(0)
        self._taken[key] = uid
        return JobUser(uid)

    def give_back(self, key: tuple[str, int]) -> None:
        uid = self._taken.pop(key, None)
        if uid is not None:
            self._free.append(uid)
