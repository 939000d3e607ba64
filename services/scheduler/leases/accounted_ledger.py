"""The lease ledger, with every released lease's device-seconds written to the usage store.

Wraps any ``LeaseLedger``: a release, wherever in the scheduler it happens (an attempt ended,
a job was cancelled, a worker was lost, a lease lapsed), accounts the time from the lease's
start to now, times its devices (a shared LoRA host's session: its share of the host's device,
1/slots), to its job and the job's tenant (charged just before the
release, so held and charged together never miss it); the tenant's current budget period is
charged only the time since it began.

A draining lease (its attempt was told to stop, its processes not yet gone: draining.py) is
charged until it is released, like any held lease: the stopped attempt's processes still hold
its devices, so the tenant pays for them and counts them in its quota until they are free. The
drain is bounded by ``drain_timeout_s``, or by the lease TTL when the worker is lost.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from opentinker.services.scheduler.errors import IdentityNotFoundError, JobNotFoundError
from opentinker.services.scheduler.jobs.job_store import JobStore
from opentinker.services.scheduler.leases.lease_ledger import (
    GroupLease,
    Lease,
    LeaseEvent,
    LeaseLedger,
)
from opentinker.services.scheduler.leases.usage import Usage, UsageStore, period_start
from opentinker.services.scheduler.tenants.identity import IdentityStore

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Charge:
    """A released lease's device-seconds as charged: all of them to the job and the tenant's
    total, ``in_period_s`` of them to the tenant's current period (of ``period_s``)."""

    job_id: str
    tenant_id: str
    period_s: float
    seconds: float
    in_period_s: float
    charge_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # one per release call


class AccountedLedger:
    """A LeaseLedger that accounts device-seconds on release; everything else is delegated."""

    def __init__(
        self, inner: LeaseLedger, *, usage: UsageStore, jobs: JobStore, identity: IdentityStore
    ) -> None:
        self._inner = inner
        self._usage = usage
        self._jobs = jobs
        self._identity = identity

    async def release(self, lease_id: str) -> bool:
        """Release and account. The time is charged first: a reader of held leases plus
        charged usage (the budget check, quotas.py) would otherwise see the lease, for a
        moment, neither held nor charged. A release that finds it gone (another path released
        it, and charged it) or fails takes the charge back."""
        lease = await self._inner.get(lease_id)
        if lease is None:
            return await self._inner.release(lease_id)
        charge = await self._charge(lease)
        released = False
        try:
            released = await self._inner.release(lease_id)
        finally:
            if not released and charge is not None:
                await self._add(charge, sign=-1.0)
        return released

    async def _charge(self, lease: Lease) -> _Charge | None:
        """Charge the lease's device-seconds to its job and tenant, this period only those
        since the period began (as the budget check counts a held lease, quotas.py): the
        charge, or None for a lease of an unknown job."""
        try:
            job = await self._jobs.get(lease.job_id)
        except JobNotFoundError:
            log.warning("lease_of_unknown_job", lease_id=lease.lease_id, job_id=lease.job_id)
            return None
        period_s = 0.0
        if job.tenant_id:
            with contextlib.suppress(IdentityNotFoundError):  # no tenant record: default period
                period_s = (await self._identity.get_tenant(job.tenant_id)).quota.period_s
        now = time.time()
        since = max(lease.created_unix_s, period_start(now, period_s))
        charge = _Charge(
            job.job_id,
            job.tenant_id,
            period_s,
            seconds=max(0.0, now - lease.created_unix_s) * lease.share,
            in_period_s=max(0.0, now - since) * lease.share,
        )
        await self._add(charge)
        return charge

    async def _add(self, charge: _Charge, *, sign: float = 1.0) -> None:
        # Keyed by the charge and its sign: the client's retry after a lost reply adds nothing
        await self._usage.add(
            charge.job_id,
            charge.tenant_id,
            Usage(device_seconds=sign * charge.seconds),
            period_s=charge.period_s,
            in_period=Usage(device_seconds=sign * charge.in_period_s),
            once=f"lease-charge:{charge.charge_id}:{'+' if sign > 0 else '-'}",
        )

    # ---- delegated as is ----------------------------------------------------------------------

    async def register_worker(self, worker_id: str, device_ids: Sequence[str]) -> None:
        await self._inner.register_worker(worker_id, device_ids)

    async def unregister_worker(self, worker_id: str) -> None:
        await self._inner.unregister_worker(worker_id)

    async def devices(self, worker_id: str) -> list[str]:
        return await self._inner.devices(worker_id)

    async def free_devices(self, worker_id: str) -> list[str]:
        return await self._inner.free_devices(worker_id)

    async def acquire(self, worker_id: str, job_id: str, n: int) -> Lease | None:
        return await self._inner.acquire(worker_id, job_id, n)

    async def acquire_share(
        self, worker_id: str, job_id: str, host_id: str, slots: int
    ) -> Lease | None:
        return await self._inner.acquire_share(worker_id, job_id, host_id, slots)

    async def acquire_group(
        self, job_id: str, parts: Sequence[tuple[str, int]], ports: tuple[int, int]
    ) -> GroupLease | None:
        return await self._inner.acquire_group(job_id, parts, ports)

    async def group_of(self, lease_id: str) -> list[str]:
        return await self._inner.group_of(lease_id)

    async def renew(self, worker_id: str) -> int:
        return await self._inner.renew(worker_id)

    async def revive(self, lease_id: str, worker_id: str, job_id: str) -> bool:
        return await self._inner.revive(lease_id, worker_id, job_id)

    async def get(self, lease_id: str) -> Lease | None:
        return await self._inner.get(lease_id)

    async def leases(self, worker_id: str) -> list[Lease]:
        return await self._inner.leases(worker_id)

    async def all_leases(self) -> list[Lease]:
        return await self._inner.all_leases()

    async def is_live(self, lease_id: str) -> bool:
        return await self._inner.is_live(lease_id)

    async def lapsed(self) -> list[Lease]:
        return await self._inner.lapsed()

    async def history(self) -> list[LeaseEvent]:
        return await self._inner.history()

    async def drain(self, lease_id: str, attempt: int, reason: str, *, rehold: bool = True) -> bool:
        return await self._inner.drain(lease_id, attempt, reason, rehold=rehold)

    async def draining(self) -> list[Lease]:
        return await self._inner.draining()
