"""CPU threads by the jobs running now: the worker writes how many threads each job process
may use, the job processes follow it before every piece of compute.

A fixed split (cores / CPU slots, set once as OMP_NUM_THREADS) keeps concurrent jobs from
oversubscribing the cores (bench/scaling.py), but a job running alone then uses a fraction of
the machine: the demo job on the 2-slot local mesh ran 0.225 s/step with 1 thread per process
against 0.098 s/step for the same GRPO in one process with 2 (bench/vs_inprocess.py). So the
worker publishes (cores - reserved) // (jobs it runs now) in a one-number file
(``ThreadShareFile``; one core is reserved for the services and the jobs' event loops,
worker/devices.py) and updates it as jobs start and end; a job process runs its compute on a
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
from typing import Any, TypeVar

import structlog

SHARE_FILE_ENV = "OPENTINKER_CPU_THREADS_FILE"  # set by the worker on every job process

log = structlog.get_logger(__name__)
_T = TypeVar("_T")


class ThreadShareFile:
    """The worker's side: ``path`` holds the threads each job process may use now."""

    def __init__(self, path: Path, *, cores: int) -> None:
        self.path = path
        self._cores = max(1, cores)

    def threads_for(self, running_jobs: int) -> int:
        return max(1, self._cores // max(1, running_jobs))

    def publish(self, running_jobs: int) -> int:
        """Write the share for ``running_jobs`` jobs (atomically: readers never see half)."""
        threads = self.threads_for(running_jobs)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{threads}\n")
        tmp.replace(self.path)
        return threads


class ThreadShareReader:
    """A job process's side: the number in the worker's file, re-read only when it changed.
    ``sharers``: processes of the job splitting that number (a job's trainer ranks on one
    worker, LOCAL_WORLD_SIZE), each taking an equal part of it (at least 1)."""

    def __init__(self, path: Path, *, sharers: int = 1) -> None:
        self.path = path
        self.sharers = max(1, sharers)
        self._stamp: tuple[int, int] | None = None
        self._threads: int | None = None

    def threads(self) -> int | None:
        """The share now; None when the file is missing or unreadable (keep what you have)."""
        try:
            stat = self.path.stat()  # a new inode per publish: mtimes can tie within a tick
            stamp = (stat.st_ino, stat.st_mtime_ns)
            if stamp != self._stamp:
                self._threads = max(1, int(self.path.read_text().strip()) // self.sharers)
                self._stamp = stamp
        except (OSError, ValueError):
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
    loop: asyncio.AbstractEventLoop | None = None, *, computing_at_once: int = 1
) -> bool:
    """Make the running loop's default executor follow the worker's share (``asyncio.to_thread``
    and ``run_in_executor(None, ...)`` then use it). False when no worker asked for it.

    ``computing_at_once``: how many of the job's processes compute at the same time
    (``LaunchConfig.computing_at_once``): each takes that part of the job's share. An RL job
    whose rollout plays the next batch while the trainer trains gives each half: with the whole
    share each, their OpenMP threads oversubscribe the cores and the demo's staleness-1 step ran
    0.049 s against 0.042 s with one thread each on 2 cores (bench/vs_inprocess.py).
    """
    path = os.environ.get(SHARE_FILE_ENV)
    if not path:
        return False
    # A job's trainer ranks on this worker (worker/ranks.py) split one process's share.
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    reader = ThreadShareReader(Path(path), sharers=ranks * max(1, computing_at_once))
    with contextlib.suppress(Exception):  # apply it to this thread too (e.g. model loading)
        apply_share(reader)
    (loop or asyncio.get_running_loop()).set_default_executor(CpuShareExecutor(reader))
    return True
