"""Jobs spanning workers: how a job bigger than every worker is split, and what each part runs.

A job whose ``num_devices`` exceeds the devices of every connected worker spans several (there
is no separate ``num_nodes`` knob: a job that fits on one worker always runs on one, where its
ranks talk over shared memory instead of the network). The split takes the fewest workers:
those with the most free devices first, all of a worker's free devices except on the last one.
The leases are taken in one Lua script (``RedisLeaseLedger.acquire_group``): all or none, so a
smaller job can never hold half of the devices a spanning job was about to take.

Ranks are numbered node by node: rank 0's worker (the first part) hosts the rendezvous
(MASTER_ADDR = its ``rendezvous_host``, MASTER_PORT = a port of its range held in the ledger
for the attempt). Every worker of the attempt gets one LaunchJob naming its rank range.

Faults: the attempt is one unit. When any of its workers is lost (closed, silent, its lease
lapsed) or any part exits killed or failed, the other workers are told to stop, their leases
held until their parts exit (draining.py), then the job is re-queued (or failed) as a whole
(scheduler.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from opentinker.common.v1 import common_pb2
from opentinker.services.scheduler.leases.draining import Drains
from opentinker.services.scheduler.leases.lease_ledger import GroupLease
from opentinker.services.scheduler.placement.worker_session import (
    LaunchCommand,
    Rendezvous,
    WorkerSession,
)


def split_across(
    needed: int, free: Sequence[tuple[WorkerSession, int]]
) -> list[tuple[WorkerSession, int]] | None:
    """``(worker, devices)`` parts summing to ``needed`` over the fewest workers (most free
    devices first, ties in connection order), or None when the free devices are too few."""
    ranked = sorted((p for p in free if p[1] > 0), key=lambda p: -p[1])
    parts: list[tuple[WorkerSession, int]] = []
    left = needed
    for session, n in ranked:
        if left == 0:
            break
        parts.append((session, min(n, left)))
        left -= parts[-1][1]
    return parts if left == 0 and len(parts) > 1 else None


def launch_commands(
    job: common_pb2.Job, members: Sequence[WorkerSession], group: GroupLease, job_token: str
) -> Iterator[tuple[WorkerSession, LaunchCommand]]:
    """One LaunchCommand per worker of the attempt, each naming its rank range."""
    world_size = sum(len(lease.device_ids) for lease in group.leases)
    rank_start = 0
    for node_rank, (session, lease) in enumerate(zip(members, group.leases, strict=True)):
        rendezvous = Rendezvous(
            master_addr=members[0].rendezvous_host,
            master_port=group.port,
            world_size=world_size,
            rank_start=rank_start,
            node_rank=node_rank,
            num_nodes=len(members),
        )
        yield session, LaunchCommand(job, lease.lease_id, lease.device_ids, job_token, rendezvous)
        rank_start += len(lease.device_ids)


def holds_part(job: common_pb2.Job, worker_id: str) -> bool:
    """Is ``worker_id`` running (a part of) the job's current attempt?"""
    return worker_id == job.worker_id or worker_id in job.worker_ids


async def end_parts(
    job: common_pb2.Job,
    reason: str,
    except_worker: str,
    sessions: Mapping[str, WorkerSession],
    drains: Drains,
) -> None:
    """Stop every other part of a multi-worker attempt, their leases held until they exit;
    release ``except_worker``'s (its part exited, or it is lost) unless already draining."""
    for worker_id in job.worker_ids:
        if worker_id != except_worker:
            await drains.stop_attempt(worker_id, job.job_id, job.attempt, reason)
            continue
        for lease in await drains.ledger.leases(worker_id):
            if lease.job_id == job.job_id and lease.drain is None:
                await drains.ledger.release(lease.lease_id)
        if (session := sessions.get(worker_id)) is not None:
            session.forget(job.job_id)
