"""Dispatch: queued jobs onto connected workers, fairly between tenants, within quotas.

One round takes the queue in order, fails jobs no connected worker could ever hold (after a
grace), and offers devices through the FairPicker (fair_share.py); a job that gets a lease is
moved to ALLOCATING (one more attempt), given a fresh job token and sent to its worker. A
re-queued job whose stopped attempt still holds devices (draining.py) waits until that attempt
is gone: two attempts of one job never run at once (both would write its checkpoints).

A placement writes several keys (the lease, the job token, the queue, the job), so a Redis
outage can cut it short. Its commit point is the job's move to ALLOCATING; what was taken before
a store error is remembered and given back at the start of the next round (``_undo``): else the
lease, renewed by the worker's heartbeats, would hold its devices for nobody, for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog

from opentinker.common.v1 import common_pb2
from opentinker.errors import OpenTinkerError
from opentinker.services.scheduler.errors import IllegalTransitionError
from opentinker.services.scheduler.jobs.queue_wait import waiting_reasons
from opentinker.services.scheduler.jobs.transitions import JobStates
from opentinker.services.scheduler.placement.affinity import by_lora_affinity, lora_base
from opentinker.services.scheduler.placement.fair_share import FairPicker, devices_needed
from opentinker.services.scheduler.placement.shared_hosts import hosted_base, shared_host_id
from opentinker.services.scheduler.placement.spanning import launch_commands, split_across
from opentinker.services.scheduler.placement.worker_session import LaunchCommand, WorkerSession
from opentinker.services.scheduler.stores import Stores
from opentinker.services.scheduler.tenants.quotas import Quotas

log = structlog.get_logger(__name__)

QUEUED = common_pb2.JOB_STATE_QUEUED
ALLOCATING = common_pb2.JOB_STATE_ALLOCATING
FAILED = common_pb2.JOB_STATE_FAILED


@dataclass(frozen=True)
class _Placement:
    """A placement not yet committed: its leases (and a job token of its job, revoked by id)."""

    job_id: str
    lease_ids: tuple[str, ...]


class Dispatcher:
    def __init__(
        self,
        stores: Stores,
        quotas: Quotas,
        states: JobStates,
        sessions: Mapping[str, WorkerSession],
        *,
        unschedulable_after_s: float,
        placing: asyncio.Lock,
        shared_lora_sessions: int = 0,
    ) -> None:
        """``shared_lora_sessions``: the LoRA sessions one shared host takes (shared_hosts.py);
        0: every session a device and a trainer of its own."""
        self._jobs = stores.jobs
        self._queue = stores.queue
        self._ledger = stores.ledger
        self._identity = stores.identity
        self._events = stores.events
        self._quotas = quotas
        self._states = states
        self._sessions = sessions  # the scheduler's live dict of connected workers
        self.unschedulable_after_s = unschedulable_after_s
        self.shared_lora_sessions = shared_lora_sessions
        self._lock = placing  # held for a round; re-queues take it too (attempt_ends.py)
        self._cut_short: list[_Placement] = []  # placements a store error interrupted
        self._held_for_budget: set[str] = set()  # queued jobs told they wait for a budget
        self._waiting_for_drain: set[str] = set()  # queued jobs said to wait for their drain
        # Each queued job's (queue position, why it waits) after the last round (queue_wait.py)
        self.waiting: dict[str, tuple[int, str]] = {}
        self._spent: dict[str, str] = {}  # tenant -> why its budget is spent, this round
        self._draining: dict[str, str] = {}  # job id -> worker its stopped attempt drains on

    async def dispatch(self) -> int:
        """One round; returns how many jobs were launched."""
        launched = 0
        async with self._lock:
            for cut in list(self._cut_short):
                await self._undo(cut)
            queued = []
            ids = await self._queue.list_ids()
            for job_id, job in zip(ids, await self._jobs.get_many(ids), strict=True):
                if job is None or job.state != QUEUED:  # gone, or cancelled meanwhile
                    await self._queue.remove(job_id)
                elif not await self._fail_if_unschedulable(job):
                    queued.append(job)
            in_queue = list(queued)
            queued = await self._within_budget(queued)
            queued = await self._not_draining(queued)
            if not self._sessions:  # nowhere to place: a worker that joins wakes a new round
                self._tell_waiting(in_queue, set(), None, {})
                return 0
            limits = await self._quotas.device_limits(j.tenant_id for j in queued)
            picker = FairPicker(
                queued,
                await self._quotas.shares_in_use(),
                limits,
                largest_worker=max((len(s.devices) for s in self._sessions.values()), default=0),
                hosted_base=hosted_base,
                host_slots=self.shared_lora_sessions,
            )
            placed_ids: set[str] = set()
            while (job := picker.next()) is not None:
                placed = await self._place(job)
                picker.done(job, placed=placed)
                launched += placed
                if placed:
                    placed_ids.add(job.job_id)
                # What each tenant holds now: a lease released meanwhile counts (fair_share.py)
                picker.in_use = await self._quotas.shares_in_use()
            self._tell_waiting(in_queue, placed_ids, picker, limits)
        return launched

    def _tell_waiting(
        self,
        in_queue: list[common_pb2.Job],
        placed: set[str],
        picker: FairPicker | None,
        limits: Mapping[str, int],
    ) -> None:
        """Record why each job still queued waits and its place: GetJob answers them, so a
        client waiting for its session to start sees why (queue_wait.py)."""
        reasons = waiting_reasons(
            in_queue,
            placed=placed,
            workers={s.worker_id: len(s.devices) for s in self._sessions.values()},
            spent=self._spent,
            draining=self._draining,
            picker=picker,
            limits=limits,
        )
        queued_now = [j for j in in_queue if j.job_id in reasons]
        self.waiting = {j.job_id: (i + 1, reasons[j.job_id]) for i, j in enumerate(queued_now)}

    async def _within_budget(self, queued: list[common_pb2.Job]) -> list[common_pb2.Job]:
        """The queued jobs whose tenant's device budget is not spent; the others wait in the
        queue for the next period (each said once per scheduler process, in the log and in the
        job's events)."""
        spent = await self._quotas.spent_budgets(j.tenant_id for j in queued)
        self._spent = dict(spent)
        for job in queued:
            if job.tenant_id in spent and job.job_id not in self._held_for_budget:
                self._held_for_budget.add(job.job_id)
                why = spent[job.tenant_id]
                log.info("job_held_budget_spent", job_id=job.job_id, why=why)
                line = common_pb2.LogLine(message=f"queued until the budget resets: {why}")
                await self._events.append(job.job_id, common_pb2.JobEvent(log=line))
        self._held_for_budget &= {j.job_id for j in queued if j.tenant_id in spent}
        return [j for j in queued if j.tenant_id not in spent]

    async def _not_draining(self, queued: list[common_pb2.Job]) -> list[common_pb2.Job]:
        """The queued jobs with no stopped attempt still holding devices; the others wait (said
        once per job in the log)."""
        draining = {lease.job_id: lease for lease in await self._ledger.draining()}
        self._draining = {job_id: lease.worker_id for job_id, lease in draining.items()}
        for job in queued:
            lease = draining.get(job.job_id)
            if lease is not None and job.job_id not in self._waiting_for_drain:
                log.info(
                    "job_waits_for_drain",
                    job_id=job.job_id,
                    lease_id=lease.lease_id,
                    worker_id=lease.worker_id,
                )
        self._waiting_for_drain = {j.job_id for j in queued if j.job_id in draining}
        return [j for j in queued if j.job_id not in draining]

    async def _place(self, job: common_pb2.Job) -> bool:
        """Lease devices for ``job`` on the first worker that has them (a LoRA RL job: those
        running LoRA jobs of its base model first, affinity.py), and launch it there; a
        job bigger than every worker spans several (spanning.py)."""
        sessions = list(self._sessions.values())
        if devices_needed(job) > max((len(s.devices) for s in sessions), default=0):
            return await self._place_across(job, sessions)
        if await self._place_hosted(job, sessions):
            return True
        for session in by_lora_affinity(sessions, job):
            lease = await self._ledger.acquire(session.worker_id, job.job_id, devices_needed(job))
            if lease is None:
                continue
            if self._stale(session):  # the worker reconnected meanwhile: its new stream's
                await self._ledger.release(lease.lease_id)  # devices, not this one's
                continue
            return await self._launch(session, job, lease.lease_id, lease.device_ids)
        return False

    async def _place_hosted(self, job: common_pb2.Job, sessions: list[WorkerSession]) -> bool:
        """A LoRA session onto a shared host of its base model with room, or a new host on a
        free device (shared_hosts.py); False when hosting is off, the job not such a session,
        or no worker has room."""
        base = hosted_base(job)
        if not (base and self.shared_lora_sessions):
            return False

        def hosting(session: WorkerSession) -> int:  # its sessions of this base now
            bases = session.lora_bases.items()
            return sum(1 for key, b in bases if b == base and key in session.running)

        # Workers already hosting this base first: a host with room there before a new host
        for session in sorted(sessions, key=hosting, reverse=True):
            host_id = shared_host_id(session.worker_id, base)
            lease = await self._ledger.acquire_share(
                session.worker_id, job.job_id, host_id, self.shared_lora_sessions
            )
            if lease is None:
                continue
            if self._stale(session):  # as in _place
                await self._ledger.release(lease.lease_id)
                continue
            return await self._launch(
                session, job, lease.lease_id, lease.device_ids, host_id=host_id
            )
        return False

    def _stale(self, session: WorkerSession) -> bool:
        """A session replaced or lost since the round listed it: a launch sent on it is dropped,
        while the worker's new stream renews every lease of the worker, so a lease taken for it
        would be held, never launched, the job ALLOCATING for good."""
        return session.lost or self._sessions.get(session.worker_id) is not session

    async def _place_across(self, job: common_pb2.Job, sessions: list[WorkerSession]) -> bool:
        """Lease the job's devices on several workers at once (all or none) and launch its
        part on each, with the rendezvous of rank 0's worker."""
        free = [(s, len(await self._ledger.free_devices(s.worker_id))) for s in sessions]
        parts = split_across(devices_needed(job), free)
        if parts is None:
            return False
        group = await self._ledger.acquire_group(
            job.job_id, [(s.worker_id, n) for s, n in parts], parts[0][0].rendezvous_ports
        )
        if group is None:  # taken meanwhile: the next round tries again
            return False
        members = [s for s, _ in parts]
        if any(self._stale(s) for s in members):  # as in _place
            for lease in group.leases:
                await self._ledger.release(lease.lease_id)
            return False
        workers = [s.worker_id for s in members]
        reason = f"leases {[g.lease_id for g in group.leases]} on workers {workers}"
        lease_ids = [lease.lease_id for lease in group.leases]
        committed = await self._commit(job, lease_ids, reason, workers)
        if committed is None:
            return False
        job, token = committed
        for session, command in launch_commands(job, members, group, token):
            session.running[(job.job_id, job.attempt)] = command.lease_id
            session.send(command)
        log.info("job_launching", job_id=job.job_id, attempt=job.attempt, worker_ids=workers)
        return True

    async def _fail_if_unschedulable(self, job: common_pb2.Job) -> bool:
        """Fail a job that needs more devices than the connected workers have together, once
        it has waited ``unschedulable_after_s`` (more workers may still be joining)."""
        total = sum(len(s.devices) for s in self._sessions.values())
        largest = max((len(s.devices) for s in self._sessions.values()), default=0)
        needed = devices_needed(job)
        waited_s = time.time() - job.updated_unix_s
        if not total or needed <= total or waited_s < self.unschedulable_after_s:
            return False
        reason = (
            f"unschedulable: the job needs {needed} devices; the connected workers have "
            f"{total} together, the largest {largest} (waited {waited_s:.0f} s)"
        )
        with contextlib.suppress(OpenTinkerError):  # moved on meanwhile
            await self._states.change(job.job_id, FAILED, reason)
            await self._queue.remove(job.job_id)
        return True

    async def _launch(
        self,
        session: WorkerSession,
        job: common_pb2.Job,
        lease_id: str,
        device_ids: tuple[str, ...],
        *,
        host_id: str = "",
    ) -> bool:
        reason = f"lease {lease_id} on worker {session.worker_id}"
        if host_id:
            reason += f" (a share of shared LoRA host {host_id})"
        committed = await self._commit(job, [lease_id], reason, [session.worker_id])
        if committed is None:
            return False
        job, token = committed
        job_id = job.job_id
        session.running[(job_id, job.attempt)] = lease_id
        if base := lora_base(job) or (hosted_base(job) if host_id else ""):
            session.lora_bases = {
                k: b for k, b in session.lora_bases.items() if k in session.running
            }
            session.lora_bases[(job_id, job.attempt)] = base
        session.send(
            LaunchCommand(
                job=job,
                lease_id=lease_id,
                device_ids=device_ids,
                job_token=token,
                host_id=host_id,
                host_slots=self.shared_lora_sessions if host_id else 0,
            )
        )
        log.info("job_launching", job_id=job_id, attempt=job.attempt, worker_id=session.worker_id)
        return True

    async def _commit(
        self, job: common_pb2.Job, lease_ids: Sequence[str], reason: str, workers: Sequence[str]
    ) -> tuple[common_pb2.Job, str] | None:
        """Issue the next attempt's job token, take the job out of the queue and move it to
        ALLOCATING on ``workers`` (rank 0's first): the placement's commit point, after which
        launching needs no store. Returns (the job, its token), or None when the job moved on
        meanwhile (cancelled), with what was taken given back. After a store error what was
        taken is given back at the next round (the error propagates: the round failed)."""
        placement = _Placement(job.job_id, tuple(lease_ids))
        self._cut_short.append(placement)
        try:
            token = await self._identity.issue_job_token(
                job.job_id, job.attempt + 1, tenant_id=job.tenant_id, user_id=job.owner_user_id
            )
            if not await self._queue.remove(job.job_id):
                raise IllegalTransitionError(f"job {job.job_id!r} left the queue")
            placed = await self._states.change(
                job.job_id,
                ALLOCATING,
                reason,
                expect_attempt=job.attempt,
                worker_id=workers[0],
                worker_ids=workers if len(workers) > 1 else (),
                next_attempt=True,
            )
        except OpenTinkerError:
            await self._undo(placement)
            return None
        self._cut_short.remove(placement)
        return placed, token

    async def _undo(self, placement: _Placement) -> None:
        """Give back what an uncommitted placement took: its leases, its job token, and the
        job's place in the queue if it is still QUEUED (it may have left the queue already)."""
        for lease_id in placement.lease_ids:
            await self._ledger.release(lease_id)
        await self._identity.revoke_job_tokens(placement.job_id)
        [job] = await self._jobs.get_many([placement.job_id])
        if job is not None and job.state == QUEUED:
            await self._queue.ensure(placement.job_id)
        self._cut_short.remove(placement)
