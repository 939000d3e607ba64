"""This node's shared LoRA hosts: one trainer process per host the scheduler placed sessions on.

The scheduler names the host of a LoRA session in LaunchJob.shared_host_id (one per worker and
base model, on a device the ledger holds for it: scheduler/placement/shared_hosts.py). The first
session of a host starts its process (trainer/session/host_process.py) on that device; each
session's attempt then hands itself to the host with OpenHostedSession, a stream that lives as long
as the session (``HostedTrainer``, which the attempt watches as it would a trainer process of its
own). The host's process is ended when its last session leaves.

A host that dies ends each of its sessions' streams: each attempt ends with exit code -1 and a
reason naming the host, which the scheduler re-queues (or fails after max_attempts).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.common.launch import wait_for_file
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.supervisor import ManagedProcess
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

log = structlog.get_logger(__name__)
HOST_MODULE = "opentinker.services.trainer.session.host_process"
CREDENTIAL_ENV = "OPENTINKER_HOST_CREDENTIAL"  # host_process.py reads it


class HostStartError(RuntimeError):
    """A host's process did not come up (it died, or was late): the attempt is re-queued."""


@dataclass(eq=False)
class TrainerHost:
    """One host's process, where it serves, and how many sessions it has now."""

    host_id: str
    process: ManagedProcess
    address: str
    credential: str  # the worker's own for this host (a worker credential, made here)
    sessions: int = 0

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


class TrainerHosts:
    """The node's hosts by id (see the module docstring)."""

    def __init__(self, settings: WorkerSettings) -> None:
        self._settings = settings
        self._hosts: dict[str, TrainerHost] = {}
        self._lock = asyncio.Lock()  # a join and a host's end never interleave

    def __len__(self) -> int:
        return sum(1 for h in self._hosts.values() if h.alive)

    async def join(
        self,
        host_id: str,
        *,
        base_model: str,
        device_ids: list[str],
        slots: int,
        env: dict[str, str],
    ) -> TrainerHost:
        """The host ``host_id`` for one more session, started when it is not running."""
        async with self._lock:
            host = self._hosts.get(host_id)
            if host is None or not host.alive:
                host = await self._start(host_id, base_model, device_ids, slots, env)
                self._hosts[host_id] = host
            host.sessions += 1
            return host

    async def leave(self, host: TrainerHost) -> None:
        """One session fewer; the host's process ends with its last."""
        async with self._lock:
            host.sessions -= 1
            if host.sessions > 0:
                return
            if self._hosts.get(host.host_id) is host:
                del self._hosts[host.host_id]
            await host.process.terminate(self._settings.stop_grace_s)
            log.info("shared_lora_host_ended", host_id=host.host_id, pid=host.process.pid)

    async def close(self) -> None:
        for host in list(self._hosts.values()):
            await host.process.terminate(self._settings.stop_grace_s)
        self._hosts.clear()

    async def _start(
        self, host_id: str, base_model: str, device_ids: list[str], slots: int, env: dict[str, str]
    ) -> TrainerHost:
        folder = (Path(self._settings.run_root) / "hosts" / host_id).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        address_file = folder / "host.addr"
        address_file.unlink(missing_ok=True)
        credential = f"otw_{secrets.token_hex(6)}_{secrets.token_urlsafe(24)}"
        argv = [
            *self._settings.trainer_command[:1],
            "-m",
            HOST_MODULE,
            "--base-model",
            base_model,
            "--device-ids",
            *device_ids,
            "--scheduler-address",
            self._settings.scheduler_address,
            "--address-file",
            str(address_file),
            "--max-sessions",
            str(max(slots, 1)),
        ]
        process = await ManagedProcess.start(
            "trainer-host",
            argv,
            log_path=folder / "host.log",
            env={**env, CREDENTIAL_ENV: credential},
            cwd=folder,
        )
        (folder / "host.pid").write_text(f"{process.pid}\n")
        timeout_s = self._settings.rollout_start_timeout_s
        try:
            address = await asyncio.to_thread(
                wait_for_file, address_file, timeout_s=timeout_s, alive=lambda: process.running
            )
        except (TimeoutError, RuntimeError) as err:
            await process.terminate(self._settings.stop_grace_s)
            raise HostStartError(
                f"shared LoRA host {host_id} of {base_model} did not start: {err} "
                f"(see {folder / 'host.log'})"
            ) from err
        log.info("shared_lora_host_started", host_id=host_id, pid=process.pid, address=address)
        return TrainerHost(host_id, process, address, credential)


class HostedTrainer:
    """One session on a host, watched as a trainer process is (``wait``, ``returncode``,
    ``terminate``, ``log_path``): its OpenHostedSession stream. ``lost`` says why it ended
    when the host went away under it ("" otherwise)."""

    def __init__(self, host: TrainerHost, log_path: Path) -> None:
        self.host, self.log_path = host, log_path
        self.returncode: int | None = None
        self.endpoint = ""
        self.lost = ""
        self._task: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        """The host's process (which serves other sessions too)."""
        return self.host.process.pid

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def open(self, launch_path: Path, rollout_address_file: Path) -> None:
        request = trainer_pb2.OpenHostedSessionRequest(
            launch_path=str(launch_path), rollout_address_file=str(rollout_address_file)
        )
        self._task = asyncio.create_task(self._follow(request))

    async def _follow(self, request: trainer_pb2.OpenHostedSessionRequest) -> None:
        try:
            async with aio_channel(self.host.address, credential=self.host.credential) as ch:
                stub = trainer_pb2_grpc.TrainerServiceStub(ch)
                async for message in stub.OpenHostedSession(request):
                    if message.ended:
                        self.returncode = message.exit_code
                    elif message.endpoint:
                        self.endpoint = message.endpoint
        except grpc.aio.AioRpcError as err:
            self.lost = await self._why_lost(f"{err.code().name}: {err.details()}")
        except asyncio.CancelledError:
            self.returncode = -signal.SIGTERM
            raise
        finally:
            if self.returncode is None:
                self.returncode = -1
                self.lost = self.lost or await self._why_lost("its stream ended without an end")

    async def _why_lost(self, detail: str) -> str:
        with contextlib.suppress(TimeoutError):  # a dying host: its exit code, when it has one
            await asyncio.wait_for(self.host.process.wait(), 2.0)
        code = self.host.process.returncode
        how = "runs on" if code is None else f"exited with code {code}"
        return (
            f"shared LoRA host {self.host.host_id} (pid {self.host.process.pid}) lost the "
            f"session: {detail}; the host {how} (see {self.host.process.log_path})"
        )

    async def wait(self) -> int:
        assert self._task is not None, "open() first"
        await asyncio.wait({self._task})  # never cancels it, nor raises its error
        return self.returncode if self.returncode is not None else -1

    async def terminate(self, grace_s: float) -> int:
        """End the session (the host ends it when its stream is cancelled)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=grace_s)
        return self.returncode if self.returncode is not None else -signal.SIGTERM
