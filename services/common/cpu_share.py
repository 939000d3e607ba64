"""CPU threads by the jobs running now: the worker writes how many threads each job process
may use, the job processes follow it before every piece of compute.

A fixed split (cores / CPU slots, set once as OMP_NUM_THREADS) keeps concurrent jobs from
oversubscribing the cores (bench/scaling.py), but a job running alone then uses a fraction of
the machine: the demo job on the 2-slot local mesh ran 0.225 s/step with 1 thread per process
against 0.098 s/step for the same GRPO in one process with 2 (bench/vs_inprocess.py). So the
worker publishes (cores - reserved) // (jobs it runs now) and cores // (jobs it runs now) in a
small file (``ThreadShareFile``; by default one core is reserved for the services and the
jobs' event loops, worker/devices.py, and a job of a small model takes the first number, any
other the second: ``LaunchConfig.leaves_cores_to_services``) and updates it as jobs start and
end; a job process runs its compute on a
thread pool (``CpuShareExecutor``, asyncio's default executor) that applies the number before
each task.

torch's intra-op thread count is per OS thread (each thread picks the global value the first
time it computes, and keeps its own after), so the count is set in the thread that computes,
right before the task: a stat of the file per task, a read only when it changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

if TYPE_CHECKING:
    from opentinker.services.common.launch import LaunchConfig

SHARE_FILE_ENV = "OPENTINKER_CPU_THREADS_FILE"  # set by the worker on every job process

log = structlog.get_logger(__name__)
_T = TypeVar("_T")


class ThreadShareFile:
    """The worker's side: ``path`` holds the threads each job process may use now, twice: with
    ``reserved`` of the ``cores`` left to the services, and with every core (for a job whose
    model is large enough to use them; ``ThreadShareReader.reserve``)."""

    def __init__(self, path: Path, *, cores: int, reserved: int = 0) -> None:
        self.path = path
        self._cores = max(1, cores)
        self._reserved = max(0, reserved)

    def threads_for(self, running_jobs: int, *, reserve: bool = True) -> int:
        cores = self._cores - self._reserved if reserve else self._cores
        return max(1, cores // max(1, running_jobs))

    def publish(self, running_jobs: int) -> int:
        """Write the shares for ``running_jobs`` jobs (atomically: readers never see half);
        returns the one with the cores reserved."""
        threads = self.threads_for(running_jobs)
        every_core = self.threads_for(running_jobs, reserve=False)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{threads} {every_core}\n")
        tmp.replace(self.path)
        return threads


class ThreadShareReader:
    """A job process's side: the number in the worker's file, re-read only when it changed.
    ``sharers``: processes of the job splitting that number (a job's trainer ranks on one
    worker, LOCAL_WORLD_SIZE), each taking an equal part of it (at least 1). ``reserve``: take
    the share that leaves the worker's reserved cores to the services (the first number), or
    the one of every core (the second; a file with one number has only the first)."""

    def __init__(self, path: Path, *, sharers: int = 1, reserve: bool = True) -> None:
        self.path = path
        self.sharers = max(1, sharers)
        self.reserve = reserve
        self._stamp: tuple[int, int] | None = None
        self._threads: int | None = None

    def threads(self) -> int | None:
        """The share now; None when the file is missing or unreadable (keep what you have)."""
        try:
            stat = self.path.stat()  # a new inode per publish: mtimes can tie within a tick
            stamp = (stat.st_ino, stat.st_mtime_ns)
            if stamp != self._stamp:
                numbers = self.path.read_text().split()
                number = numbers[0] if self.reserve or len(numbers) < 2 else numbers[1]
                self._threads = max(1, int(number) // self.sharers)
                self._stamp = stamp
        except (OSError, ValueError, IndexError):
            return None
        return self._threads


def apply_share(reader: ThreadShareReader) -> None:
    """Set this thread's torch thread count to the share, if it differs."""
    threads = reader.threads()
    if threads is None:
        return
    import torch  # noqa: PLC0415 - job processes have it; the worker imports this module too

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.debug("cpu_threads_set", threads=threads)


def _shared(reader: ThreadShareReader, fn: Callable[..., _T], args: Any, kwargs: Any) -> _T:
    apply_share(reader)
    return fn(*args, **kwargs)


class CpuShareExecutor(ThreadPoolExecutor):
    """A thread pool whose tasks run with the worker's current CPU share."""

    def __init__(self, reader: ThreadShareReader) -> None:
        super().__init__(thread_name_prefix="compute")
        self._reader = reader

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        return super().submit(_shared, self._reader, fn, args, kwargs)


def follow_worker_share(
    loop: asyncio.AbstractEventLoop | None = None,
    *,
    computing_at_once: int = 1,
    reserve: bool = True,
) -> bool:
    """Make the running loop's default executor follow the worker's share (``asyncio.to_thread``
    and ``run_in_executor(None, ...)`` then use it). False when no worker asked for it.

    ``computing_at_once``: how many of the job's processes compute at the same time
    (``LaunchConfig.computing_at_once``): each takes that part of the job's share. An RL job
    whose rollout plays the next batch while the trainer trains gives each half: with the whole
    share each, their OpenMP threads oversubscribe the cores and the demo's staleness-1 step ran
    0.049 s against 0.042 s with one thread each on 2 cores (bench/vs_inprocess.py).
    ``reserve``: leave the worker's reserved cores to the services
    (``LaunchConfig.leaves_cores_to_services``: a small model's job).
    """
    path = os.environ.get(SHARE_FILE_ENV)
    if not path:
        return False
    # A job's trainer ranks on this worker (worker/ranks.py) split one process's share.
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    reader = ThreadShareReader(
        Path(path), sharers=ranks * max(1, computing_at_once), reserve=reserve
    )
    with contextlib.suppress(Exception):  # apply it to this thread too (e.g. model loading)
        apply_share(reader)
    (loop or asyncio.get_running_loop()).set_default_executor(CpuShareExecutor(reader))
    return True


def follow_job_share(launch: LaunchConfig | None) -> bool:
    """``follow_worker_share`` as a job's launch sets it: how many of its processes compute at
    once, and whether its model leaves the worker's reserved cores to the services. A process
    without a launch (a node's shared rollout) computes alone and leaves them."""
    if launch is None:
        return follow_worker_share()
    return follow_worker_share(
        computing_at_once=launch.computing_at_once, reserve=launch.leaves_cores_to_services
    )
