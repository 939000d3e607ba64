"""Why a queued job waits: said to its owner, never a silent wait.

After each dispatch round, every job still QUEUED gets the reason it was not placed, the first
that applies: no worker connected; its tenant's budget spent; its stopped attempt still
draining; its tenant at its device quota; more devices than one worker has and no set of
workers with enough free; else every device it could use is leased. GetJob answers it with the
job's queue position (``Job.queue_position``/``queue_reason``), so a client waiting for its
session to start (the SDK, the Tinker gateway) can say why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentinker.common.v1 import common_pb2
from opentinker.services.scheduler.placement.fair_share import FairPicker, devices_needed


def waiting_reasons(
    queued: Sequence[common_pb2.Job],
    *,
    placed: set[str],
    workers: Mapping[str, int],
    spent: Mapping[str, str],
    draining: Mapping[str, str],
    picker: FairPicker | None,
    limits: Mapping[str, int],
) -> dict[str, str]:
    """job id -> reason, for each of ``queued`` not in ``placed``.

    workers: devices of each connected worker; spent: tenant -> why its budget is spent;
    draining: job id -> the worker its stopped attempt still holds devices on; picker: the
    round's (None when no round ran: no worker); limits: each tenant's max_devices."""
    out: dict[str, str] = {}
    largest, total = max(workers.values(), default=0), sum(workers.values())
    for job in queued:
        if job.job_id in placed:
            continue
        needed = devices_needed(job)
        if not workers:
            why = "no worker is connected; it is placed when one joins"
        elif job.tenant_id in spent:
            why = f"the tenant's budget is spent ({spent[job.tenant_id]}); it waits for the reset"
        elif job.job_id in draining:
            why = f"its previous attempt is still stopping on worker {draining[job.job_id]}"
        elif picker is not None and not picker.fits_quota(job):
            held, limit = picker.in_use.get(job.tenant_id, 0), limits.get(job.tenant_id, 0)
            why = (
                f"the tenant's jobs hold {held:g} of its {limit} devices (max_devices); it "
                f"needs {picker.needed(job):g} more"
            )
        elif needed > largest:
            why = (
                f"it needs {needed} devices across workers ({total} connected, largest "
                f"{largest}); not enough are free at once"
            )
        else:
            why = (
                f"waiting for {needed} free device(s): every device of the {len(workers)} "
                f"connected worker(s) that could hold it is leased"
            )
        out[job.job_id] = why
    return out
