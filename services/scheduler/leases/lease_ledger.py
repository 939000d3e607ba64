"""The GPU lease ledger: which devices each worker offers, and which job holds which device.

A lease holds N devices of one worker for one job. Each held device is a Redis key
``<prefix>:device:<device_id> = <lease_id>`` with a TTL (``lease_ttl_s``); the worker's heartbeats
renew it. A worker that stops heartbeating loses its devices when the TTL runs out: the lease is
then *lapsed* (some of its device keys are gone or belong to another lease), its devices are free
for others, and ``lapsed()`` lists it so the scheduler can re-queue its job.

Redis layout (``prefix`` defaults to ``ot:ledger``)::

    <prefix>:worker:<worker_id>:devices   LIST of device ids, in the order the worker offered them
    <prefix>:worker:<worker_id>:leases    SET of lease ids
    <prefix>:device:<device_id>           STRING lease id (a shared host's: its host id), PX = TTL
    <prefix>:lease:<lease_id>             HASH worker_id, job_id, devices ("\\n"-joined), created
                                          [group ("\\n"-joined lease ids), port: multi-worker]
                                          [drain_attempt, drain_since, drain_reason: draining]
                                          [host, slots: a share of a shared LoRA host]
    <prefix>:worker:<worker_id>:ports     SET rendezvous ports held by its rank-0 group leases
    <prefix>:host:<host_id>               HASH worker_id, devices, slots (a shared LoRA host)
    <prefix>:host:<host_id>:leases        SET of its shares' lease ids
    <prefix>:leases                       SET of every lease id not yet released
    <prefix>:draining                     SET of the draining lease ids
    <prefix>:history                      STREAM acquire/release/revive/drain events (LeaseEvent)

A *draining* lease belongs to an attempt the scheduler told to stop (cancelled, re-queued): its
job has moved on, but its devices stay held, renewed by its worker's heartbeats as any lease,
until the scheduler releases it (the worker reported the attempt's processes exited, or the
drain timed out, or it lapsed: draining.py).

Every change that touches several keys is one Lua script, so concurrent schedulers or
coroutines can never hand one device to two jobs. The scripts build key names from ``prefix``,
so the ledger needs one Redis (not a cluster).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from opentinker.services.scheduler.leases import lease_scripts
from opentinker.services.scheduler.redis_text import as_text


@dataclass(frozen=True)
class Drain:
    """Why a lease is draining: ``attempt`` of its job was told to stop, at ``since_unix_s``
    (wall-clock seconds), for ``reason``; its devices stay held until its processes are gone."""

    attempt: int
    since_unix_s: float
    reason: str


@dataclass(frozen=True)
class Lease:
    """Devices held by one job on one worker. ``created_unix_s`` is wall-clock seconds;
    ``drain`` is set once its attempt was told to stop (draining.py)."""

    lease_id: str
    worker_id: str
    job_id: str
    device_ids: tuple[str, ...]
    created_unix_s: float
    drain: Drain | None = None
    host_id: str = ""  # a share of this shared LoRA host (acquire_share), else ""
    host_slots: int = 0  # how many sessions that host takes: the share is 1/host_slots

    @property
    def share(self) -> float:
        """The devices the lease holds for its job: all of them, or its part of a host's."""
        return len(self.device_ids) / self.host_slots if self.host_id else len(self.device_ids)


@dataclass(frozen=True)
class LeaseEvent:
    """One entry of the ledger's history. ``at_unix_s``: when Redis wrote it."""

    kind: str  # "acquire" | "release" | "revive" | "drain"
    lease_id: str
    job_id: str
    worker_id: str
    device_ids: tuple[str, ...]
    at_unix_s: float
    group: tuple[str, ...] = ()  # acquire of a multi-worker attempt: every lease taken with it
    host_id: str = ""  # acquire of a share of this shared LoRA host (acquire_share)


@dataclass(frozen=True)
class GroupLease:
    """Devices on several workers held for one job: one Lease per worker, rank 0's first, and
    the rendezvous port held on rank 0's worker until its lease is released."""

    leases: tuple[Lease, ...]
    port: int


HISTORY_MAX_EVENTS = 100_000  # approximately; older history is trimmed


class LeaseLedger(Protocol):
    """Atomic, expiring device leases. Every method is safe to call concurrently."""

    async def register_worker(self, worker_id: str, device_ids: Sequence[str]) -> None:
        """Record the devices a worker offers (replacing what it offered before)."""

    async def unregister_worker(self, worker_id: str) -> None:
        """Forget a worker's devices; its leases stay until released or lapsed."""

    async def devices(self, worker_id: str) -> list[str]:
        """The devices a worker offers, in its order."""

    async def free_devices(self, worker_id: str) -> list[str]:
        """The worker's devices that no live lease holds."""

    async def acquire(self, worker_id: str, job_id: str, n: int) -> Lease | None:
        """Take ``n`` free devices of the worker at once, or none (returns None)."""

    async def acquire_share(
        self, worker_id: str, job_id: str, host_id: str, slots: int
    ) -> Lease | None:
        """One of the ``slots`` sessions of the shared LoRA host ``host_id`` on the worker (a
        free device taken for the host by its first share, freed by its last one's release),
        or None: no free device for a new host, or the host full or not live."""

    async def acquire_group(
        self, job_id: str, parts: Sequence[tuple[str, int]], ports: tuple[int, int]
    ) -> GroupLease | None:
        """Take ``n`` devices on each ``(worker_id, n)`` (rank 0's first) and a free port of
        rank 0's ``ports`` = (base, count) range, all at once, or nothing (None)."""

    async def group_of(self, lease_id: str) -> list[str]:
        """The lease ids acquired together with ``lease_id``; [] for a one-worker lease."""

    async def renew(self, worker_id: str) -> int:
        """Extend every live lease of the worker by the TTL; returns how many were renewed."""

    async def release(self, lease_id: str) -> bool:
        """Free the lease's devices; False when there was no such lease. Idempotent."""

    async def get(self, lease_id: str) -> Lease | None:
        """The lease, live or lapsed, until it is released."""

    async def leases(self, worker_id: str) -> list[Lease]:
        """The worker's leases not yet released (live or lapsed)."""

    async def all_leases(self) -> list[Lease]:
        """Every lease not yet released (live or lapsed), of any worker, connected or not."""

    async def is_live(self, lease_id: str) -> bool:
        """True while every device of the lease is still held by it."""

    async def lapsed(self) -> list[Lease]:
        """Leases (of any worker) whose devices ran out of TTL, not yet released."""

    async def history(self) -> list[LeaseEvent]:
        """Every acquire, release, revive and drain, oldest first (the newest
        HISTORY_MAX_EVENTS)."""

    async def drain(self, lease_id: str, attempt: int, reason: str, *, rehold: bool = True) -> bool:
        """Keep the lease's devices held for its stopped ``attempt`` until it is released: mark
        it draining (the first drain's time and reason are kept) and, with ``rehold``, hold
        again for a TTL those of its devices no lease holds (a lapsed lease's). False when
        there is no such lease."""

    async def draining(self) -> list[Lease]:
        """Every draining lease not yet released, of any worker."""

    async def revive(self, lease_id: str, worker_id: str, job_id: str) -> bool:
        """Hold the lease's devices again for a TTL, for a worker that reconnected still running
        it: True when the lease (not released) is this worker's and this job's and none of its
        devices is held by another lease; False (and nothing changed) otherwise."""


class RedisLeaseLedger:
    """LeaseLedger on one Redis; ``lease_ttl_s`` may be fractional (stored as milliseconds)."""

    def __init__(
        self, client: aioredis.Redis, *, lease_ttl_s: float, prefix: str = "ot:ledger"
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self._r = client
        self._prefix = prefix
        self._ttl_ms = max(1, round(lease_ttl_s * 1000))
        self._acquire = client.register_script(lease_scripts.ACQUIRE)
        self._renew = client.register_script(lease_scripts.RENEW)
        self._release = client.register_script(lease_scripts.RELEASE)
        self._is_live = client.register_script(lease_scripts.IS_LIVE)
        self._lapsed = client.register_script(lease_scripts.LAPSED)
        self._revive = client.register_script(lease_scripts.REVIVE)
        self._acquire_group = client.register_script(lease_scripts.ACQUIRE_GROUP)
        self._drain = client.register_script(lease_scripts.DRAIN)
        self._acquire_share = client.register_script(lease_scripts.ACQUIRE_SHARE)

    def _key(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    async def register_worker(self, worker_id: str, device_ids: Sequence[str]) -> None:
        key = self._key("worker", worker_id, "devices")
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if device_ids:
                pipe.rpush(key, *device_ids)
            await pipe.execute()

    async def unregister_worker(self, worker_id: str) -> None:
        await self._r.delete(self._key("worker", worker_id, "devices"))

    async def devices(self, worker_id: str) -> list[str]:
        raw = await self._r.lrange(self._key("worker", worker_id, "devices"), 0, -1)
        return [as_text(d) for d in raw]

    async def free_devices(self, worker_id: str) -> list[str]:
        devices = await self.devices(worker_id)
        if not devices:
            return []
        held = await self._r.exists(*[self._key("device", d) for d in devices])
        if held == 0:
            return devices
        async with self._r.pipeline(transaction=False) as pipe:
            for d in devices:
                pipe.exists(self._key("device", d))
            flags = await pipe.execute()
        return [d for d, flag in zip(devices, flags, strict=True) if not flag]

    async def acquire(self, worker_id: str, job_id: str, n: int) -> Lease | None:
        if n < 1:
            raise ValueError(f"a lease needs at least one device, asked for {n}")
        lease_id = f"lease-{uuid.uuid4().hex[:16]}"
        now = time.time()
        taken = await self._acquire(
            args=[
                self._prefix,
                worker_id,
                job_id,
                n,
                lease_id,
                self._ttl_ms,
                repr(now),
                HISTORY_MAX_EVENTS,
            ]  # fmt: skip
        )
        if not taken:
            return None
        return Lease(lease_id, worker_id, job_id, tuple(as_text(d) for d in taken), now)

    async def acquire_share(
        self, worker_id: str, job_id: str, host_id: str, slots: int
    ) -> Lease | None:
        if slots < 1 or not host_id:
            raise ValueError(f"a share needs a host id and >= 1 slot, got {host_id!r}, {slots}")
        lease_id = f"lease-{uuid.uuid4().hex[:16]}"
        now = time.time()
        args: list[str | int] = [self._prefix, worker_id, job_id, host_id, slots, lease_id]
        args += [self._ttl_ms, repr(now), HISTORY_MAX_EVENTS]
        taken = await self._acquire_share(args=args)
        if not taken:
            return None
        return await self.get(lease_id)

    async def acquire_group(
        self, job_id: str, parts: Sequence[tuple[str, int]], ports: tuple[int, int]
    ) -> GroupLease | None:
        """Take ``n`` free devices on each ``(worker_id, n)`` of ``parts`` (rank 0's first) and
        a free port of rank 0's range ``ports`` = (base, count), all at once, or nothing
        (None). No other acquire can slip in between: one Lua script."""
        if len(parts) < 2 or any(n < 1 for _, n in parts):
            raise ValueError(f"a group lease needs >= 2 parts of >= 1 device, got {parts}")
        ids = [f"lease-{uuid.uuid4().hex[:16]}" for _ in parts]
        now = time.time()
        args: list[str | int] = [self._prefix, job_id, self._ttl_ms, repr(now), HISTORY_MAX_EVENTS]
        args += [ports[0], ports[1]]
        for (worker_id, n), lease_id in zip(parts, ids, strict=True):
            args += [worker_id, n, lease_id]
        taken = await self._acquire_group(args=args)
        if not taken:
            return None
        leases = tuple(
            Lease(lease_id, worker_id, job_id, tuple(as_text(devices).split("\n")), now)
            for (worker_id, _), lease_id, devices in zip(parts, ids, taken[1:], strict=True)
        )
        return GroupLease(leases, int(as_text(taken[0])))

    async def group_of(self, lease_id: str) -> list[str]:
        """The lease ids acquired together with ``lease_id`` (itself included), [] for a
        one-worker lease or one already released."""
        joined = await self._r.hget(self._key("lease", lease_id), "group")
        return [i for i in as_text(joined).split("\n") if i] if joined else []

    async def renew(self, worker_id: str) -> int:
        return int(await self._renew(args=[self._prefix, worker_id, self._ttl_ms]))

    async def release(self, lease_id: str) -> bool:
        # A call id: the client's retry of this call after a lost reply answers as it did
        call_id = uuid.uuid4().hex
        args: list[str | int] = [self._prefix, lease_id, HISTORY_MAX_EVENTS, call_id]
        return bool(await self._release(args=args))

    async def get(self, lease_id: str) -> Lease | None:
        fields = await self._r.hgetall(self._key("lease", lease_id))
        if not fields:
            return None
        f = {as_text(k): as_text(v) for k, v in fields.items()}
        drain = None
        if "drain_since" in f:
            drain = Drain(int(f["drain_attempt"]), float(f["drain_since"]), f["drain_reason"])
        return Lease(
            lease_id=lease_id,
            worker_id=f["worker_id"],
            job_id=f["job_id"],
            device_ids=tuple(d for d in f["devices"].split("\n") if d),
            created_unix_s=float(f["created"]),
            drain=drain,
            host_id=f.get("host", ""),
            host_slots=int(f.get("slots", "0")),
        )

    async def leases(self, worker_id: str) -> list[Lease]:
        ids = await self._r.smembers(self._key("worker", worker_id, "leases"))
        return await self._load(sorted(as_text(i) for i in ids))

    async def all_leases(self) -> list[Lease]:
        ids = await self._r.smembers(self._key("leases"))
        return await self._load(sorted(as_text(i) for i in ids))

    async def is_live(self, lease_id: str) -> bool:
        return bool(await self._is_live(args=[self._prefix, lease_id]))

    async def lapsed(self) -> list[Lease]:
        ids = await self._lapsed(args=[self._prefix])
        return await self._load([as_text(i) for i in ids])

    async def revive(self, lease_id: str, worker_id: str, job_id: str) -> bool:
        ttl_ms, max_events = self._ttl_ms, HISTORY_MAX_EVENTS
        args: list[str | int] = [self._prefix, lease_id, worker_id, job_id, ttl_ms, max_events]
        return bool(await self._revive(args=args))

    async def drain(self, lease_id: str, attempt: int, reason: str, *, rehold: bool = True) -> bool:
        args: list[str | int] = [self._prefix, lease_id, attempt, repr(time.time()), reason]
        args += [self._ttl_ms, HISTORY_MAX_EVENTS, int(rehold)]
        return bool(await self._drain(args=args))

    async def draining(self) -> list[Lease]:
        ids = await self._r.smembers(self._key("draining"))
        return await self._load(sorted(as_text(i) for i in ids))

    async def history(self) -> list[LeaseEvent]:
        # redis-py types the reply, an entry's id and its fields as optional (XAUTOCLAIM's
        # deleted entries); XRANGE gives a list of whole entries.
        entries = await self._r.xrange(self._key("history")) or []
        return [_event(i, fields) for i, fields in entries if i is not None and fields is not None]

    async def _load(self, lease_ids: Sequence[str]) -> list[Lease]:
        out = []
        for lease_id in lease_ids:
            lease = await self.get(lease_id)
            if lease is not None:
                out.append(lease)
        return out


def _event(entry_id: bytes | str, fields: dict) -> LeaseEvent:
    f = {as_text(k): as_text(v) for k, v in fields.items()}
    return LeaseEvent(
        kind=f["event"],
        lease_id=f["lease_id"],
        job_id=f.get("job_id", ""),
        worker_id=f.get("worker_id", ""),
        device_ids=tuple(d for d in f.get("devices", "").split("\n") if d),
        at_unix_s=int(as_text(entry_id).split("-")[0]) / 1000,
        group=tuple(i for i in f.get("group", "").split("\n") if i),
        host_id=f.get("host", ""),
    )
