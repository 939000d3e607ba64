"""Which queued job to try next: fair between tenants, by priority within one, within quota.

Between tenants: the tenant whose jobs hold the fewest devices goes first (ties: whose
candidate was queued earlier), so a tenant that floods the queue cannot starve another — each
free device goes to whoever holds least. Within a tenant: higher ``priority`` first, then queue
order. A job that would take its tenant past ``max_devices`` is not offered (it waits; it is
refused at submit if it could never fit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from opentinker.common.v1 import common_pb2


def devices_needed(job: common_pb2.Job) -> int:
    return max(job.spec.num_devices, 1)


@dataclass
class _Entry:
    job: common_pb2.Job
    position: int  # in the queue, 0 = front


class FairPicker:
    """Offers queued jobs one at a time; tell it whether each was placed (``done``).

    jobs: queued jobs in queue order. in_use: devices each tenant's jobs hold now.
    max_devices: each tenant's limit (0 or missing = none).
    """

    def __init__(
        self,
        jobs: Sequence[common_pb2.Job],
        in_use: Mapping[str, int],
        max_devices: Mapping[str, int],
    ) -> None:
        self.in_use = dict(in_use)
        self._limits = dict(max_devices)
        self._by_tenant: dict[str, list[_Entry]] = {}
        for position, job in enumerate(jobs):
            self._by_tenant.setdefault(job.tenant_id, []).append(_Entry(job, position))
        for entries in self._by_tenant.values():
            entries.sort(key=lambda e: (-e.job.spec.priority, e.position))

    def fits_quota(self, job: common_pb2.Job) -> bool:
        limit = self._limits.get(job.tenant_id, 0)
        return not limit or self.in_use.get(job.tenant_id, 0) + devices_needed(job) <= limit

    def next(self) -> common_pb2.Job | None:
        """The job to try now, or None when no tenant has one within its quota."""
        best: tuple[int, int] | None = None
        chosen: common_pb2.Job | None = None
        for tenant, entries in self._by_tenant.items():
            entry = next((e for e in entries if self.fits_quota(e.job)), None)
            if entry is None:
                continue
            rank = (self.in_use.get(tenant, 0), entry.position)
            if best is None or rank < best:
                best, chosen = rank, entry.job
        return chosen

    def done(self, job: common_pb2.Job, *, placed: bool) -> None:
        """Take ``job`` out of the running; count its devices against its tenant if placed."""
        entries = self._by_tenant.get(job.tenant_id, [])
        self._by_tenant[job.tenant_id] = [e for e in entries if e.job.job_id != job.job_id]
        if placed:
            self.in_use[job.tenant_id] = self.in_use.get(job.tenant_id, 0) + devices_needed(job)
