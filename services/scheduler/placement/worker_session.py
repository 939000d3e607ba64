"""A connected worker agent as the scheduler sees it, and the commands it can be sent.

The servicer turns each command into a ConnectWorkerResponse; the domain never sees protobuf
envelopes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from opentinker.common.v1 import common_pb2


@dataclass(frozen=True)
class DeviceOffer:
    """One device a worker offers: a GPU ("cuda") or a CPU slot ("cpu")."""

    device_id: str  # unique across the cluster, e.g. "node-a/cuda:0"
    kind: str
    memory_bytes: int = 0


DEFAULT_RENDEZVOUS_PORTS = (29500, 64)  # (base, count) when a worker names no range


@dataclass(frozen=True)
class Rendezvous:
    """One worker's part of a job spanning workers (scheduler.proto MultiNodeRendezvous)."""

    master_addr: str
    master_port: int
    world_size: int
    rank_start: int
    node_rank: int
    num_nodes: int


@dataclass(frozen=True)
class LaunchCommand:
    job: common_pb2.Job  # attempt already counted
    lease_id: str
    device_ids: tuple[str, ...]
    job_token: str  # the attempt's own credential (identity.proto)
    rendezvous: Rendezvous | None = None  # only for a job spanning workers
    host_id: str = ""  # a LoRA session placed on this shared host (shared_hosts.py)
    host_slots: int = 0  # the sessions that host takes


@dataclass(frozen=True)
class StopCommand:
    job_id: str
    reason: str
    attempt: int = 0  # 0 = every attempt of the job on the worker


@dataclass(frozen=True)
class CloseCommand:
    """The scheduler ends the session (shutting down, or the worker stopped heartbeating)."""

    reason: str


WorkerCommand = LaunchCommand | StopCommand | CloseCommand


@dataclass(eq=False)
class WorkerSession:
    """One ConnectWorker stream. ``outbox`` is drained by the servicer; None ends the stream."""

    worker_id: str
    hostname: str
    devices: tuple[DeviceOffer, ...]
    outbox: asyncio.Queue[WorkerCommand | None] = field(default_factory=asyncio.Queue)
    last_seen: float = field(default_factory=time.monotonic)
    lost: bool = False
    # (job_id, attempt) -> lease_id of what this worker was told to run
    running: dict[tuple[str, int], str] = field(default_factory=dict)
    # (job_id, attempt) -> base model of the LoRA RL jobs launched here (affinity.py; only
    # those still in ``running`` count)
    lora_bases: dict[tuple[str, int], str] = field(default_factory=dict)
    renewal: asyncio.Task[None] | None = None  # the lease renewal in flight, if any
    key_prefix: str = ""  # of the credential it connected with (checked again while connected)
    credential_check: asyncio.Task[None] | None = None  # the check in flight, if any
    rendezvous_host: str = ""  # MASTER_ADDR when it holds rank 0 of a multi-worker job
    rendezvous_ports: tuple[int, int] = DEFAULT_RENDEZVOUS_PORTS  # (base, count)

    def send(self, command: WorkerCommand) -> None:
        if not self.lost or isinstance(command, CloseCommand):
            self.outbox.put_nowait(command)

    def forget(self, job_id: str) -> list[tuple[str, int]]:
        """Drop every run of ``job_id`` from ``running``; the (job_id, attempt) keys dropped."""
        keys = [key for key in self.running if key[0] == job_id]
        for key in keys:
            del self.running[key]
        return keys

    def end_stream(self) -> None:
        self.outbox.put_nowait(None)
