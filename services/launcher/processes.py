"""Start service processes, wait until their gRPC health check says SERVING, stop them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from opentinker.services.common.launch import wait_for_file
from opentinker.services.worker.supervisor import with_parent_death_signal


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the service binds it right after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ServiceProcess:
    """One running service: its name, process, log file and (for gRPC services) address."""

    name: str
    process: subprocess.Popen
    log_path: Path
    address: str = ""
    module: str = ""  # what `start` ran, so `restarted` can run it again
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(
        cls, name: str, module: str, *, env: dict[str, str], log_dir: Path, address: str = ""
    ) -> ServiceProcess:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed with it
        # SIGTERM when this process dies, even by SIGKILL or SIGHUP (a closed terminal), which
        # run no clean-up: the service shuts down as on `stop` instead of keeping its port.
        process = subprocess.Popen(
            with_parent_death_signal([sys.executable, "-m", module], signal.SIGTERM),
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return cls(name, process, log_path, address, module, dict(env))

    def restarted(self) -> ServiceProcess:
        """The same service started again (same module, environment, address and log)."""
        return ServiceProcess.start(
            self.name, self.module, env=self.env, log_dir=self.log_path.parent, address=self.address
        )

    def wait_address(
        self, address_file: Path, *, timeout_s: float = 60.0, port_variable: str = "OPENTINKER_PORT"
    ) -> str:
        """The host:port a service started on port 0 wrote to ``address_file`` once serving
        (OPENTINKER_ADDRESS_FILE); its port is kept in ``port_variable`` for a restart."""
        try:
            address = wait_for_file(address_file, timeout_s=timeout_s, alive=self.alive)
        except RuntimeError:
            self._fail_if_dead()
            raise
        except TimeoutError:
            raise TimeoutError(
                f"{self.name} did not say its address within {timeout_s:.0f} s; see "
                f"{self.log_path}:\n{log_tail(self.log_path)}"
            ) from None
        self.env[port_variable] = address.rpartition(":")[2]  # a restart takes it again
        return address

    def kill(self) -> None:
        """SIGKILL the process, as a crash would (nothing is flushed or told)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_serving(self, *, timeout_s: float = 60.0) -> None:
        """Block until the gRPC health check answers SERVING; fail fast if the process died."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._fail_if_dead()
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(
            f"{self.name} at {self.address} was not SERVING within {timeout_s:.0f} s; "
            f"see {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def _fail_if_dead(self) -> None:
        if not self.alive():
            raise RuntimeError(
                f"{self.name} exited with code {self.process.returncode} while starting; "
                f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
            )

    def wait_http(self, url: str, *, timeout_s: float = 60.0) -> None:
        """Block until ``url`` answers 200 (an HTTP service); fail fast if the process died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._fail_if_dead()
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1.0) as reply:
                if reply.status == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not answer {url} within {timeout_s:.0f} s; "
                           f"see {self.log_path}:\n{log_tail(self.log_path)}")  # fmt: skip

    def stop(self, *, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL it after ``grace_s``."""
        if not self.alive():
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)
