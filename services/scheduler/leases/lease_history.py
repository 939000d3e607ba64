"""Proof from the ledger's history that no job ran twice at once and no device was double-booked.

Replays the acquire/release events: a device taken while another unreleased lease holds it, or
a job acquiring a second lease while its first is unreleased, is a double lease (except the
leases of one multi-worker attempt, taken together as one group; and the shares of one shared
LoRA host, which hold its device together until the last is released). (A lapsed
lease counts as held until the scheduler releases it: its worker may still be running it; so
does a draining one, whose job's next attempt waits for its release: dispatch.py.)
"""

from __future__ import annotations

from collections.abc import Iterable

from opentinker.services.scheduler.leases.lease_ledger import LeaseEvent


def double_leases(events: Iterable[LeaseEvent]) -> list[str]:
    """What went wrong, one line each; empty when every lease was exclusive."""
    held_devices: dict[str, str] = {}  # device -> lease
    job_leases: dict[str, set[str]] = {}  # job -> its unreleased leases
    lease_job: dict[str, tuple[str, tuple[str, ...], str]] = {}  # -> job, devices, holder
    problems = []
    hosts: dict[str, set[str]] = {}  # shared host -> its unreleased shares
    for e in events:
        if e.kind == "acquire":
            holder = f"host {e.host_id}" if e.host_id else e.lease_id
            if e.host_id:
                hosts.setdefault(holder, set()).add(e.lease_id)
            for device in e.device_ids:
                if device in held_devices and held_devices[device] != holder:
                    problems.append(
                        f"device {device}: lease {e.lease_id} (job {e.job_id}) taken while "
                        f"lease {held_devices[device]} still held it"
                    )
                held_devices[device] = holder
            others = job_leases.get(e.job_id, set()) - set(e.group)
            if others:
                problems.append(
                    f"job {e.job_id}: lease {e.lease_id} taken while lease "
                    f"{min(others)} was not released (two attempts at once)"
                )
            job_leases.setdefault(e.job_id, set()).add(e.lease_id)
            lease_job[e.lease_id] = (e.job_id, e.device_ids, holder)
        elif e.kind == "release" and e.lease_id in lease_job:
            job_id, devices, holder = lease_job.pop(e.lease_id)
            hosts.get(holder, set()).discard(e.lease_id)
            for device in devices:
                if held_devices.get(device) == holder and not hosts.get(holder):
                    del held_devices[device]
            job_leases.get(job_id, set()).discard(e.lease_id)
    return problems
