"""Run untrusted Python (the model's code) with limits that it cannot lift.

Layers, from the outside in:
- its own process group (a new session) and, where the OS allows (``bwrap``, else
  ``unshare``), new PID and network namespaces: no network at all, and when the sandbox's first
  process dies the kernel kills every process left in it, so a fork bomb or a ``setsid`` child
  cannot outlive the run;
- where bubblewrap can make one (``sandbox_root.py``), a root of its own: the system's
  libraries, Python's installation and the run's folder, nothing else (no service folder, no
  other run, no checkout, so no job id of any tenant to list);
- a wall-clock timeout that kills the whole group (and so the namespace);
- resource limits on CPU seconds, address space, file size, open files, processes, core
  dumps, set by ``prlimit`` before the sandbox starts (never by a ``preexec_fn``: forking with
  Python code to run in the child is unsafe in a threaded process such as a gRPC server, and
  crashed there; ``preexec_fn`` is only the fallback where ``prlimit`` is missing); output
  read up to a limit, after which the run is killed;
- the user ``nobody`` when started as root (via ``setpriv``), so nothing private is readable or
  writable and the process limit applies; a fresh temporary folder as the working directory,
  deleted afterwards; a minimal environment (no inherited secrets);
- inside Python, ``sandbox_guard`` refuses processes, sockets, ctypes and files outside the
  folder with a clear error.
``isolation()`` says which OS layers this machine allows; where one is missing (no
``bwrap``, no ``unshare`` or no privilege for namespaces) the rest still apply, best effort,
and the start-up log says which are missing.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog

from opentinker.services.envhub.games.sandbox_root import bwrap_prefix

GUARD = Path(__file__).with_name("sandbox_guard.py")
NOBODY = 65534
_PROBE_TIMEOUT_S = 5.0

log = structlog.get_logger("opentinker.envhub.games.sandbox")


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use.

    wall_time_s: seconds of real time before the whole tree is killed.
    cpu_time_s: CPU seconds per process (RLIMIT_CPU). memory_bytes: address space per process.
    output_bytes: stdout+stderr kept; more kills the run. file_bytes: largest file it may
    write. processes: processes of the sandbox user (RLIMIT_NPROC; as ``nobody`` the count is
    shared by every run at once, so it bounds a fork bomb, not one run). open_files: descriptors.
    """

    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_bytes: int = 1 << 30
    output_bytes: int = 16 * 1024
    file_bytes: int = 1 << 20
    processes: int = 256
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended.

    output: stdout and stderr interleaved, at most ``output_bytes`` (decoded, invalid UTF-8
    replaced). exit_code: the process's code, negative for a signal (e.g. -9 killed,
    -24 SIGXCPU); None when killed by the timeout. timed_out: the wall clock ran out.
    output_truncated: the output limit was hit and the run killed.
    """

    output: str
    exit_code: int | None
    timed_out: bool
    output_truncated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated


@dataclass(frozen=True)
class Isolation:
    """The OS layers this machine allows: namespaces via ``unshare``, dropping to nobody,
    limits set by the ``prlimit`` command, a root of its own via ``bwrap`` (own_root: the
    namespaces come with it, and ``unshare`` is then not used)."""

    namespaces: bool
    drop_to_nobody: bool
    prlimit: bool = False
    own_root: bool = False


@functools.cache
def isolation() -> Isolation:
    """Probe once per process which OS layers work here (each probe has a timeout)."""
    drop = os.geteuid() == 0 and shutil.which("setpriv") is not None
    namespaces = shutil.which("unshare") is not None and _works(
        [*_unshare_prefix(), *(_setpriv_prefix() if drop else []), "true"]
    )
    prlimit = shutil.which("prlimit") is not None and _works(
        [*_prlimit_prefix(SandboxLimits()), "true"]
    )
    own_root = shutil.which("bwrap") is not None and _bwrap_works(drop)
    found = Isolation(
        namespaces=namespaces or own_root, drop_to_nobody=drop, prlimit=prlimit, own_root=own_root
    )
    log.info(
        "sandbox_isolation",
        namespaces=found.namespaces,
        drop_to_nobody=found.drop_to_nobody,
        prlimit=found.prlimit,
        own_root=found.own_root,
    )
    if not own_root:
        log.warning(
            "sandbox_sees_the_host_filesystem",
            fix="install bubblewrap (apt-get install bubblewrap): without it sandboxed code "
            "can list the host's folders (e.g. the run and checkpoint roots)",
        )
    return found


def _bwrap_works(drop: bool) -> bool:
    """Python starts in a root of its own (as the sandbox's user when ``drop``)."""
    with tempfile.TemporaryDirectory(prefix="opentinker-sandbox-probe-") as folder:
        if drop:
            os.chown(folder, NOBODY, NOBODY)
        user = _setpriv_prefix() if drop else []
        prefix = bwrap_prefix(folder, as_root=os.geteuid() == 0)
        return _works([*prefix, *user, sys.executable, "-I", "-c", "import os; os.listdir('.')"])


def run_python(
    code: str, *, limits: SandboxLimits = SandboxLimits(), guard: bool = True
) -> SandboxResult:
    """Run ``code`` as a Python script in a fresh sandbox and return its output.

    guard: install ``sandbox_guard`` (the in-Python tripwire); off only to test the OS layers.
    """
    where = isolation()
    with tempfile.TemporaryDirectory(prefix="opentinker-sandbox-") as folder:
        cell = Path(folder) / "cell.py"
        cell.write_text(code, encoding="utf-8")
        if where.drop_to_nobody:
            os.chown(folder, NOBODY, NOBODY)
            os.chown(cell, NOBODY, NOBODY)
        # The guard goes in as source text (-c), never as a path: the sandbox user need not
        # be able to read the checkout (a clone under a 0700 home).
        command = [sys.executable, "-I", "-u", *(["-c", _guard_source()] if guard else [])]
        command.append(str(cell))
        if where.drop_to_nobody:
            command = [*_setpriv_prefix(), *command]
        if where.own_root:
            command = [*bwrap_prefix(folder, as_root=os.geteuid() == 0), *command]
        elif where.namespaces:
            command = [*_unshare_prefix(), *command]
        if where.prlimit:  # outermost: every process of the sandbox inherits the limits
            command = [*_prlimit_prefix(limits), *command]
        return _run(command, cwd=folder, limits=limits, preexec_limits=not where.prlimit)


@functools.cache
def _guard_source() -> str:
    return GUARD.read_text(encoding="utf-8")


def _run(
    command: list[str], *, cwd: str, limits: SandboxLimits, preexec_limits: bool
) -> SandboxResult:
    env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
    process = subprocess.Popen(  # noqa: S603 - the command is ours; the code is in a file
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: killpg reaches the whole tree
        preexec_fn=functools.partial(_apply_limits, limits) if preexec_limits else None,
    )
    assert process.stdout is not None
    reader = _BoundedReader(process.stdout, limits.output_bytes)
    reader.start()
    timed_out = False
    try:
        process.wait(timeout=limits.wall_time_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    # Timed out, too much output, or exited: whatever is left of its group goes.
    _kill_group(process)
    reader.join(timeout=5.0)
    exit_code = None if timed_out else process.returncode
    return SandboxResult(
        output=reader.text(),
        exit_code=exit_code,
        timed_out=timed_out,
        output_truncated=reader.truncated.is_set(),
    )


class _BoundedReader(threading.Thread):
    """Reads a pipe to EOF, keeping at most ``limit`` bytes; past that, kills the run."""

    def __init__(self, pipe, limit: int) -> None:  # noqa: ANN001 - a binary file object
        super().__init__(daemon=True, name="sandbox-output")
        self._pipe = pipe
        self._limit = limit
        self._chunks: list[bytes] = []
        self._size = 0
        self.truncated = threading.Event()

    def run(self) -> None:
        with self._pipe:
            while chunk := self._pipe.read1(65536):
                room = self._limit - self._size
                if room > 0:
                    self._chunks.append(chunk[:room])
                    self._size += min(room, len(chunk))
                if len(chunk) > room:
                    self.truncated.set()
                    return

    def text(self) -> str:
        return b"".join(self._chunks).decode("utf-8", errors="replace")


def _apply_limits(limits: SandboxLimits) -> None:
    """In the child, before exec: limits that the sandboxed code cannot raise again."""
    # CPU: SIGXCPU at the soft limit (the guard turns it into an error the model reads),
    # SIGKILL at the hard limit a second later.
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_time_s, limits.cpu_time_s + 1))
    for kind, value in (
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_FSIZE, limits.file_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(kind, (value, value))


def _prlimit_prefix(limits: SandboxLimits) -> list[str]:
    """The same limits as ``_apply_limits``, set by util-linux ``prlimit`` before it execs."""
    return [
        "prlimit",
        f"--cpu={limits.cpu_time_s}:{limits.cpu_time_s + 1}",
        f"--as={limits.memory_bytes}",
        f"--fsize={limits.file_bytes}",
        f"--nofile={limits.open_files}",
        f"--nproc={limits.processes}",
        "--core=0",
        "--",
    ]


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _unshare_prefix() -> list[str]:
    # A new network namespace (no interfaces but a down loopback) and PID namespace whose
    # first process takes every other one with it when it dies; --kill-child ties that first
    # process to unshare itself. Without root, --map-root-user makes the namespaces possible.
    prefix = ["unshare", "--net", "--pid", "--fork", "--kill-child"]
    return prefix if os.geteuid() == 0 else [*prefix, "--map-root-user"]


def _setpriv_prefix() -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


def _works(command: list[str]) -> bool:
    try:
        probe = subprocess.run(  # noqa: S603 - fixed commands
            command, capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0
