"""The lease ledger, with every released lease's device-seconds written to the usage store.

Wraps any ``LeaseLedger``: a release, wherever in the scheduler it happens (an attempt ended,
a job was cancelled, a worker was lost, a lease lapsed), accounts the time from the lease's
start to now, times its devices, to its job and the job's tenant (charged just before the
release, so held and charged together never miss it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import structlog

from opentinker.services.scheduler.errors import IdentityNotFoundError, JobNotFoundError
from opentinker.services.scheduler.identity import IdentityStore
from opentinker.services.scheduler.job_store import JobStore
from opentinker.services.scheduler.lease_ledger import (
    GroupLease,
    Lease,
    LeaseEvent,
    LeaseLedger,
)
from opentinker.services.scheduler.usage import Usage, UsageStore

log = structlog.get_logger(__name__)


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
                job_id, tenant_id, seconds, period_s = charge
                await self._usage.add(
                    job_id, tenant_id, Usage(device_seconds=-seconds), period_s=period_s
                )
        return released

    async def _charge(self, lease: Lease) -> tuple[str, str, float, float] | None:
        """Charge the lease's device-seconds to its job and tenant: (job, tenant, seconds,
        period) as charged, or None for a lease of an unknown job."""
        seconds = max(0.0, time.time() - lease.created_unix_s) * len(lease.device_ids)
        try:
            job = await self._jobs.get(lease.job_id)
        except JobNotFoundError:
            log.warning("lease_of_unknown_job", lease_id=lease.lease_id, job_id=lease.job_id)
            return None
        period_s = 0.0
        if job.tenant_id:
            with contextlib.suppress(IdentityNotFoundError):  # no tenant record: default period
                period_s = (await self._identity.get_tenant(job.tenant_id)).quota.period_s
        await self._usage.add(
            job.job_id, job.tenant_id, Usage(device_seconds=seconds), period_s=period_s
        )
        return job.job_id, job.tenant_id, seconds, period_s

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
