"""Child processes that are never orphaned.

Each child runs in its own process group (so its own children are signalled too), dies with the
agent on Linux (PR_SET_PDEATHSIG, even when the agent is SIGKILLed), writes stdout+stderr to a
log file, and is stopped with SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

# Linux: a tiny exec shim asks the kernel to SIGKILL the child when the agent dies, even by
# SIGKILL, then becomes the real program (the setting survives exec). It runs as its own
# interpreter because a preexec_fn would fork a process that holds gRPC's threads and locks.
_PDEATHSIG_SHIM = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[2]))  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(70)  # the parent died before the shim ran\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def with_parent_death_signal(
    argv: Sequence[str], sig: signal.Signals = signal.SIGKILL
) -> list[str]:
    """``argv`` wrapped so that the process gets ``sig`` when this one dies (Linux only;
    unchanged elsewhere). The kernel ties this to the *thread* that starts the child, so start
    long-lived children from the main thread or the event-loop thread."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    shim = [sys.executable, "-I", "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), str(int(sig))]
    return [*shim, *argv]


class ManagedProcess:
    """One supervised child process. Create with ``await ManagedProcess.start(...)``."""

    def __init__(
        self,
        name: str,
        process: asyncio.subprocess.Process,
        log_path: Path,
        reports: asyncio.StreamReader | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._process = process
        self._reports = reports

    @classmethod
    async def start(
        cls,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str],
        cwd: Path | None = None,
        stdin_pipe: bool = False,
        report_pipe: str = "",
    ) -> ManagedProcess:
        """``stdin_pipe``: keep a pipe to the child's stdin (``hand_over`` writes to it).
        ``report_pipe``: an environment variable naming the write end of a pipe the child
        reports on (JSON lines, ``next_report``)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(env)
        pass_fds: tuple[int, ...] = ()
        reports: asyncio.StreamReader | None = None
        if report_pipe:
            read_fd, write_fd = os.pipe()
            env[report_pipe], pass_fds = str(write_fd), (write_fd,)
        try:
            with open(log_path, "ab") as log_file:
                process = await asyncio.create_subprocess_exec(
                    *with_parent_death_signal(argv),
                    stdin=asyncio.subprocess.PIPE if stdin_pipe else asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                    pass_fds=pass_fds,
                )
        finally:
            for fd in pass_fds:  # the child's end
                os.close(fd)
        if report_pipe:
            reports = asyncio.StreamReader()
            protocol = asyncio.StreamReaderProtocol(reports)
            await asyncio.get_running_loop().connect_read_pipe(
                lambda: protocol, os.fdopen(read_fd, "rb", buffering=0)
            )
        log.info("process_started", name=name, pid=process.pid, log=str(log_path))
        return cls(name, process, log_path, reports)

    async def hand_over(self, line: bytes, log_path: Path, *, keep_open: bool = False) -> None:
        """Send one line on stdin (a warm spare's job); its log moves with it. Stdin is closed
        after it unless ``keep_open`` (a reusable spare reads its next job there)."""
        stdin = self._process.stdin
        if stdin is None:
            raise RuntimeError(f"{self.name} was started without a stdin pipe")
        stdin.write(line)
        await stdin.drain()
        if not keep_open:
            stdin.close()
        self.log_path = log_path

    @property
    def reports(self) -> bool:
        return self._reports is not None

    async def next_report(self) -> dict | None:
        """The next JSON line the child reported; None once it closed the pipe (exited)."""
        if self._reports is None:
            return None
        line = await self._reports.readline()
        return json.loads(line) if line.strip() else None

    def close_stdin(self) -> None:
        """A spare reads EOF and exits: retired without a job."""
        if self._process.stdin is not None:
            self._process.stdin.close()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    @property
    def running(self) -> bool:
        return self._process.returncode is None

    async def wait(self) -> int:
        return await self._process.wait()

    async def terminate(self, grace_s: float) -> int:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; returns the exit code."""
        if self.running:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._process.wait(), timeout=grace_s)
            except TimeoutError:
                log.warning("process_killed", name=self.name, pid=self.pid, grace_s=grace_s)
        # Whatever the leader did, leave nothing of its group behind.
        self._signal_group(signal.SIGKILL)
        return await self._process.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, sig)


def last_meaningful_line(path: Path, *, max_chars: int = 500) -> str:
    """The last non-blank line of a log file (e.g. a traceback's ``ValueError: ...``)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16_384))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    for line in reversed(tail.splitlines()):
        if line.strip():
            return line.strip()[:max_chars]
    return ""
