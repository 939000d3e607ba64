"""FairPicker: the order in which queued jobs are offered devices (pure; no Redis)."""

from __future__ import annotations

import pytest

from opentinker.common.v1 import common_pb2
from opentinker.services.scheduler.placement.fair_share import FairPicker

pytestmark = pytest.mark.unit


def job(job_id: str, tenant: str, *, devices: int = 1, priority: int = 0) -> common_pb2.Job:
    spec = common_pb2.JobSpec(num_devices=devices, priority=priority)
    return common_pb2.Job(job_id=job_id, tenant_id=tenant, spec=spec)


def drain(picker: FairPicker, free_devices: int) -> list[str]:
    """Offer jobs until the devices run out; a job that does not fit is passed over."""
    order = []
    while (candidate := picker.next()) is not None:
        needed = max(candidate.spec.num_devices, 1)
        placed = needed <= free_devices
        if placed:
            free_devices -= needed
            order.append(candidate.job_id)
        picker.done(candidate, placed=placed)
    return order


def test_a_tenant_that_floods_the_queue_does_not_starve_another() -> None:
    # acme queued 6 jobs before globex queued 1; 4 devices free.
    queue = [job(f"a{i}", "acme") for i in range(6)] + [job("g0", "globex")]
    # Hand-derived: acme 0 held -> a0; then acme 1 vs globex 0 -> g0; then acme gets the rest.
    assert drain(FairPicker(queue, {}, {}), free_devices=4) == ["a0", "g0", "a1", "a2"]


def test_the_tenant_holding_fewer_devices_goes_first() -> None:
    queue = [job("a0", "acme"), job("g0", "globex")]
    assert drain(FairPicker(queue, {"acme": 3, "globex": 1}, {}), free_devices=1) == ["g0"]


def test_priority_orders_a_tenants_own_jobs_only() -> None:
    queue = [job("a-low", "acme"), job("a-high", "acme", priority=5), job("g0", "globex")]
    # acme's urgent job jumps acme's line, not globex's turn.
    assert drain(FairPicker(queue, {}, {}), free_devices=3) == ["a-high", "g0", "a-low"]


def test_a_job_past_its_tenants_device_quota_waits_but_smaller_ones_go() -> None:
    queue = [job("big", "acme", devices=3), job("small", "acme", devices=1)]
    picker = FairPicker(queue, {"acme": 1}, {"acme": 2})
    assert picker.fits_quota(queue[1]) and not picker.fits_quota(queue[0])
    assert drain(picker, free_devices=8) == ["small"]  # 1 held + 1 = 2: at the quota now
    assert picker.in_use["acme"] == 2


def test_a_job_that_does_not_fit_the_free_devices_is_passed_over() -> None:
    queue = [job("wide", "acme", devices=4), job("narrow", "acme", devices=1)]
    assert drain(FairPicker(queue, {}, {}), free_devices=2) == ["narrow"]


def test_once_a_one_worker_job_finds_no_room_none_as_large_is_offered_that_round() -> None:
    """A round must not outlast its look at what each tenant holds: trying every queued job
    on a full pool took long enough for a device freed meanwhile to go by that stale look."""
    queue = [job(f"a{i}", "acme") for i in range(50)] + [job("wide", "acme", devices=4)]
    picker = FairPicker(queue, {"acme": 2}, {}, largest_worker=2)
    offered = []
    while (candidate := picker.next()) is not None:
        offered.append(candidate.job_id)
        picker.done(candidate, placed=False)
    assert offered == ["a0", "wide"]  # the wide one spans workers: it may still fit there
