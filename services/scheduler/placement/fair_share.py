"""Which queued job to try next: fair between tenants, by priority within one, within quota.

Between tenants: the tenant whose jobs hold the fewest devices goes first (ties: whose
candidate was queued earlier), so a tenant that floods the queue cannot starve another — each
free device goes to whoever holds least. Within a tenant: higher ``priority`` first, then queue
order. A job that would take its tenant past ``max_devices`` is not offered (it waits; it is
refused at submit if it could never fit).

A round ranks tenants by what they hold when it looks, so it must not outlast that look:
once a job that fits on one worker finds no room, no job as large is offered for the rest of
the round (none would fit either), and the dispatcher reads the devices held again before each
offer. A round over a long queue used to try every queued job, long enough that a device freed
meanwhile went to whoever was next by the round's first look: a tenant already holding one
took the device of the tenant that had just dropped to none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    max_devices: each tenant's limit (0 or missing = none). largest_worker: the most devices
    one worker has (a job needing more spans workers); 0 = unknown.

    Sessions on shared LoRA hosts (shared_hosts.py): ``hosted_base`` gives a job's base model
    when it may share a host (else ""), and ``host_slots`` the sessions a host takes. Such a
    job needs 1/host_slots of a device (its share: ``in_use`` then holds fractions), and its
    room is a host of its base, not a free device: one that found none stops only the jobs of
    its base for the round, and a whole-device job that found none does not stop it.
    """

    def __init__(
        self,
        jobs: Sequence[common_pb2.Job],
        in_use: Mapping[str, float],
        max_devices: Mapping[str, int],
        *,
        largest_worker: int = 0,
        hosted_base: Callable[[common_pb2.Job], str] = lambda job: "",
        host_slots: int = 0,
    ) -> None:
        self.in_use = dict(in_use)
        self._limits = dict(max_devices)
        self._largest_worker = largest_worker
        self._hosted_base = hosted_base if host_slots > 0 else (lambda job: "")
        self._host_slots = host_slots
        self._no_room_from: int | None = None  # one-worker jobs this large found no room
        self._no_host_room: set[str] = set()  # base models whose sessions found no host room
        self._by_tenant: dict[str, list[_Entry]] = {}
        for position, job in enumerate(jobs):
            self._by_tenant.setdefault(job.tenant_id, []).append(_Entry(job, position))
        for entries in self._by_tenant.values():
            entries.sort(key=lambda e: (-e.job.spec.priority, e.position))

    def needed(self, job: common_pb2.Job) -> float:
        """The devices ``job`` takes: a shared host's share, or whole ones."""
        return 1 / self._host_slots if self._hosted_base(job) else devices_needed(job)

    def fits_quota(self, job: common_pb2.Job) -> bool:
        limit = self._limits.get(job.tenant_id, 0)
        held = self.in_use.get(job.tenant_id, 0)
        return not limit or round(held + self.needed(job), 6) <= limit

    def _offerable(self, job: common_pb2.Job) -> bool:
        if base := self._hosted_base(job):
            return self.fits_quota(job) and base not in self._no_host_room
        needed = devices_needed(job)
        no_room = self._no_room_from is not None and self._no_room_from <= needed
        return self.fits_quota(job) and not (no_room and needed <= self._largest_worker)

    def next(self) -> common_pb2.Job | None:
        """The job to try now, or None when no tenant has one within its quota."""
        best: tuple[float, int] | None = None
        chosen: common_pb2.Job | None = None
        for tenant, entries in self._by_tenant.items():
            entry = next((e for e in entries if self._offerable(e.job)), None)
            if entry is None:
                continue
            rank = (self.in_use.get(tenant, 0), entry.position)
            if best is None or rank < best:
                best, chosen = rank, entry.job
        return chosen

    def done(self, job: common_pb2.Job, *, placed: bool) -> None:
        """Take ``job`` out of the running; count its devices against its tenant if placed.
        A one-worker job not placed found no room on any worker (or, rarely, moved on: then
        the others of its size wait one round)."""
        entries = self._by_tenant.get(job.tenant_id, [])
        self._by_tenant[job.tenant_id] = [e for e in entries if e.job.job_id != job.job_id]
        needed = devices_needed(job)
        if placed:
            self.in_use[job.tenant_id] = self.in_use.get(job.tenant_id, 0) + self.needed(job)
        elif base := self._hosted_base(job):
            self._no_host_room.add(base)
        elif needed <= self._largest_worker:
            self._no_room_from = min(needed, self._no_room_from or needed)
