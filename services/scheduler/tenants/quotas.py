"""Tenant quotas and usage as the scheduler applies them: at submit, at dispatch, in reports.

- submit: a priority above the tenant's ``max_priority``, or more devices than its
  ``max_devices``, is refused (the job could never run as asked); a tenant whose device-seconds
  this period reached its budget gets RESOURCE_EXHAUSTED with the numbers.
- dispatch: the devices each tenant holds now (from the ledger) and each tenant's limit feed
  the FairPicker (fair_share.py). A tenant whose budget is spent gets no new lease: its queued
  jobs wait for the next period (jobs running then finish their attempt). Spent counts the
  leases it holds now, to this moment, beside those already released and accounted: else a
  tenant could queue many jobs while its first ran and start them all past its budget.
- reports: each step adds its tokens and one step to the job's and tenant's usage; each result
  row of an inference job adds the tokens its episode generated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from opentinker.common.v1 import common_pb2
from opentinker.errors import PermissionDeniedError, ResourceExhaustedError
from opentinker.scheduler.v1 import identity_pb2, scheduler_pb2
from opentinker.services.scheduler.errors import IdentityNotFoundError
from opentinker.services.scheduler.jobs.job_store import JobStore
from opentinker.services.scheduler.leases.lease_ledger import Lease, LeaseLedger
from opentinker.services.scheduler.leases.usage import (
    DEFAULT_PERIOD_S,
    Usage,
    UsageStore,
    period_start,
)
from opentinker.services.scheduler.tenants.identity import IdentityStore

# Step metrics the trainer reports that count as tokens (see the trainer loop).
TOKENS_GENERATED_METRIC = "tokens_generated"
TOKENS_TRAINED_METRIC = "tokens_trained"


class Quotas:
    def __init__(
        self, identity: IdentityStore, usage: UsageStore, ledger: LeaseLedger, jobs: JobStore
    ) -> None:
        self._identity = identity
        self._usage = usage
        self._ledger = ledger
        self._jobs = jobs

    async def quota(self, tenant_id: str) -> identity_pb2.TenantQuota:
        """The tenant's quota; none (all zeros) for a job without a tenant record."""
        try:
            return (await self._identity.get_tenant(tenant_id)).quota
        except IdentityNotFoundError:
            return identity_pb2.TenantQuota()

    async def check_submit(self, spec: common_pb2.JobSpec, tenant_id: str) -> None:
        """Raise when the job may not be queued for ``tenant_id`` (see the module docstring)."""
        quota = await self.quota(tenant_id)
        if quota.max_priority and spec.priority > quota.max_priority:
            raise PermissionDeniedError(
                f"priority: {spec.priority} is above tenant {tenant_id!r}'s max_priority "
                f"{quota.max_priority}; ask an admin or lower it",
                reason="PRIORITY_ABOVE_QUOTA",
            )
        needed = max(spec.num_devices, 1)
        if quota.max_devices and needed > quota.max_devices:
            raise ResourceExhaustedError(
                f"num_devices: the job needs {needed} devices, tenant {tenant_id!r} may hold at "
                f"most {quota.max_devices} at once; it could never run",
                reason="ABOVE_DEVICE_QUOTA",
            )
        if spent := (await self.spent_budgets([tenant_id])).get(tenant_id):
            raise ResourceExhaustedError(spent, reason="DEVICE_BUDGET_SPENT")

    async def spent_budgets(self, tenant_ids: Iterable[str]) -> dict[str, str]:
        """The tenants of ``tenant_ids`` whose device-seconds this period, the leases they
        hold now counted to this moment, reached their budget: tenant -> why, with when it
        resets."""
        now = time.time()
        held: list[tuple[str, Lease]] | None = None
        spent = {}
        for tenant_id in set(tenant_ids):
            quota = await self.quota(tenant_id)
            budget = quota.device_seconds_per_period
            if not budget:
                continue
            period_s = quota.period_s or DEFAULT_PERIOD_S
            start = period_start(now, period_s)
            used, _ = await self._usage.tenant(tenant_id, period_s=period_s)
            held = await self._leases_by_tenant() if held is None else held
            running = sum(
                (now - max(lease.created_unix_s, start)) * lease.share
                for tenant, lease in held
                if tenant == tenant_id
            )
            if used.device_seconds + running >= budget:
                resets = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start + period_s))
                spent[tenant_id] = (
                    f"tenant {tenant_id!r} used {used.device_seconds + running:,.0f} of its "
                    f"{budget:,.0f} device-seconds this period (the leases it holds now "
                    f"{running:,.0f} of them); the budget resets at {resets}"
                )
        return spent

    async def shares_in_use(self) -> dict[str, float]:
        """As ``devices_in_use``, a shared host's session counted as its share (1/slots)."""
        held: dict[str, float] = {}
        for tenant, lease in await self._leases_by_tenant():
            held[tenant] = held.get(tenant, 0.0) + lease.share
        return held

    async def devices_in_use(self) -> dict[str, int]:
        """Devices held by each tenant's jobs: every lease not yet released, also those of
        workers not connected now (a dropped stream, a scheduler restart), whose jobs keep
        running and are adopted again when their worker re-announces them. A session on a
        shared LoRA host holds its share of the host's device (1/slots): a tenant's shares add
        up, and a part of a device counts as a whole one."""
        return {t: math.ceil(round(n, 6)) for t, n in (await self.shares_in_use()).items()}

    async def _leases_by_tenant(self) -> list[tuple[str, Lease]]:
        """Every lease not yet released, with its job's tenant ("" for a job that is gone)."""
        leases = await self._ledger.all_leases()
        jobs = await self._jobs.get_many([lease.job_id for lease in leases])
        return [
            (job.tenant_id if job is not None else "", lease)
            for lease, job in zip(leases, jobs, strict=True)
        ]

    async def device_limits(self, tenant_ids: Iterable[str]) -> dict[str, int]:
        return {t: (await self.quota(t)).max_devices for t in set(tenant_ids)}

    async def record_step(
        self, job: common_pb2.Job, step: common_pb2.StepMetrics, *, report_id: str = ""
    ) -> None:
        """One step and its tokens; a report sent again with its ``report_id`` (a retry)
        counts once."""
        metrics = step.metrics
        usage = Usage(
            steps=1.0,
            tokens_generated=metrics.get(TOKENS_GENERATED_METRIC, 0.0),
            tokens_trained=metrics.get(TOKENS_TRAINED_METRIC, 0.0),
        )
        await self.record_usage(job, usage, report_id=report_id)

    async def record_generated(
        self, job: common_pb2.Job, tokens: float, *, report_id: str = ""
    ) -> None:
        """Tokens generated outside training steps (an inference job's episode)."""
        await self.record_usage(job, Usage(tokens_generated=tokens), report_id=report_id)

    async def record_usage(self, job: common_pb2.Job, usage: Usage, *, report_id: str) -> None:
        """``usage`` of ``job``, counted once per ``report_id`` (a retried report)."""
        quota = await self.quota(job.tenant_id)
        once = f"report:{report_id}" if report_id else ""
        await self._usage.add(job.job_id, job.tenant_id, usage, period_s=quota.period_s, once=once)

    async def report(
        self, tenant_id: str, devices_in_use: int, *, max_jobs: int
    ) -> scheduler_pb2.TenantUsage:
        """The tenant's usage, quota and its newest ``max_jobs`` jobs with theirs."""
        quota = await self.quota(tenant_id)
        period_s = quota.period_s or DEFAULT_PERIOD_S
        period, total = await self._usage.tenant(tenant_id, period_s=period_s)
        page = await self._jobs.list_jobs(page_size=max_jobs, tenant_id=tenant_id)
        jobs = [
            scheduler_pb2.JobUsage(
                job_id=j.job_id,
                name=j.spec.name,
                state=j.state,
                usage=(await self._usage.job(j.job_id)).to_proto(),
            )
            for j in page.jobs
        ]
        return scheduler_pb2.TenantUsage(
            tenant_id=tenant_id,
            period=period.to_proto(),
            period_start_unix_s=period_start(time.time(), period_s),
            period_s=period_s,
            total=total.to_proto(),
            devices_in_use=devices_in_use,
            quota=quota,
            jobs=jobs,
        )
