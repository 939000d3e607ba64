"""Read-only views for dashboards: the connected workers with their devices and leases, and
the last step of many jobs at once. Knows nothing of gRPC; changes nothing."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from opentinker.common.v1 import common_pb2
from opentinker.errors import InvalidArgumentError, NotFoundError
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.scheduler.jobs.job_store import JobStore
from opentinker.services.scheduler.leases.lease_ledger import Lease, LeaseLedger
from opentinker.services.scheduler.placement.worker_session import WorkerSession

MAX_PROGRESS_JOBS = 500
DEFAULT_WORKER_PAGE = 100


class Overview:
    """What the scheduler can show of its workers and jobs' progress, tenant by tenant."""

    def __init__(
        self, sessions: Mapping[str, WorkerSession], ledger: LeaseLedger, jobs: JobStore
    ) -> None:
        self._sessions, self._ledger, self._jobs = sessions, ledger, jobs

    async def workers(
        self, *, tenant: str | None, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[scheduler_pb2.WorkerStatus], str]:
        """Connected workers by id after ``page_token``, and the next page's token ('' at the
        end). A lease's job shows only to its ``tenant`` (None = every tenant, an admin)."""
        size = page_size if page_size > 0 else DEFAULT_WORKER_PAGE
        ids = sorted(w for w in self._sessions if w > page_token)
        page, more = ids[:size], len(ids) > size
        statuses = [await self._worker(self._sessions[w], tenant) for w in page if w in
                    self._sessions]  # fmt: skip
        return statuses, page[-1] if more and page else ""

    async def _worker(
        self, session: WorkerSession, tenant: str | None
    ) -> scheduler_pb2.WorkerStatus:
        held: dict[str, list[Lease]] = {}  # device -> its lease (a shared host's: its shares)
        for taken in await self._ledger.leases(session.worker_id):
            for device_id in taken.device_ids:
                held.setdefault(device_id, []).append(taken)
        devices = []
        for offer in session.devices:
            leases = held.get(offer.device_id, [])
            lease = await self._shown(leases, tenant)
            device = scheduler_pb2.DeviceStatus(
                device_id=offer.device_id,
                kind=offer.kind,
                memory_bytes=offer.memory_bytes,
                leased=bool(leases),
            )
            if leases and leases[0].host_id:
                device.shared_host_id = leases[0].host_id
                device.hosted_sessions, device.host_slots = len(leases), leases[0].host_slots
            if lease is not None and lease.drain is not None:
                device.draining = True
                device.draining_since_unix_s = lease.drain.since_unix_s
            if lease is not None and await self._visible(lease.job_id, tenant):
                device.lease_id, device.job_id = lease.lease_id, lease.job_id
                device.leased_since_unix_s = lease.created_unix_s
            devices.append(device)
        return scheduler_pb2.WorkerStatus(
            worker_id=session.worker_id,
            hostname=session.hostname,
            devices=devices,
            last_seen_s_ago=max(time.monotonic() - session.last_seen, 0.0),
            lost=session.lost,
        )

    async def _shown(self, leases: list[Lease], tenant: str | None) -> Lease | None:
        """The lease a device shows: its one lease, or of a shared host's shares the first
        the caller may see (the first of all when it sees none: its job is then hidden)."""
        for lease in leases:
            if await self._visible(lease.job_id, tenant):
                return lease
        return leases[0] if leases else None

    async def _visible(self, job_id: str, tenant: str | None) -> bool:
        if tenant is None:
            return True
        try:
            return (await self._jobs.get(job_id)).tenant_id == tenant
        except NotFoundError:
            return False

    async def last_steps(
        self, job_ids: Sequence[str], *, tenant: str | None
    ) -> dict[str, common_pb2.StepMetrics]:
        """job_id -> the last step of its current attempt, for the jobs ``tenant`` owns (None
        = any); unknown jobs, others' jobs and jobs with no step yet are left out."""
        if len(job_ids) > MAX_PROGRESS_JOBS:
            raise InvalidArgumentError(
                f"job_ids: {len(job_ids)} ids, at most {MAX_PROGRESS_JOBS} per call; "
                "ask for the rest in another call"
            )
        steps = {}
        for job_id in dict.fromkeys(job_ids):
            try:
                job = await self._jobs.get(job_id)
            except NotFoundError:
                continue
            if tenant is not None and job.tenant_id != tenant:
                continue
            report = await self._jobs.report(job_id, job.attempt)
            if report.last_step is not None:
                steps[job_id] = report.last_step
        return steps
