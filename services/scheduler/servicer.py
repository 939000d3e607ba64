"""SchedulerService over gRPC: protobuf <-> Scheduler calls, domain errors -> status codes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.errors import (
    ConfigError,
    OpenTinkerError,
)
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.auth import (
    JOBS,
    USERS,
    WORKERS,
    current_principal,
    require_job,
    rules_for,
)
from opentinker.services.common.grpc_server import abort, abort_with
from opentinker.services.scheduler.jobs.recovery import HeldAttempt
from opentinker.services.scheduler.placement.spanning import holds_part
from opentinker.services.scheduler.placement.worker_session import (
    CloseCommand,
    DeviceOffer,
    LaunchCommand,
    Rendezvous,
    StopCommand,
    WorkerCommand,
    WorkerSession,
)
from opentinker.services.scheduler.scheduler import Scheduler

log = structlog.get_logger(__name__)

# Who may call what; the servicer narrows further (own tenant, own job, own worker id).
ACCESS_RULES = rules_for(
    scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
    {
        "SubmitJob": USERS,
        "GetJob": USERS,
        "ListJobs": USERS,
        "CancelJob": USERS,
        "WatchJob": USERS,
        "ReportJobProgress": JOBS,
        "GetUsage": USERS,
        "ConnectWorker": WORKERS,
        "ListWorkers": USERS,
        "GetJobsProgress": USERS,
    },
)


def _scope() -> str | None:
    """The tenant whose jobs the caller sees (None for an admin: every tenant)."""
    return current_principal().tenant_scope


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    async def SubmitJob(
        self, request: scheduler_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitJobResponse:
        try:
            job = await self._scheduler.submit(
                request.spec, owner=current_principal(), request_id=request.request_id
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return scheduler_pb2.SubmitJobResponse(job=job)

    async def GetJob(
        self, request: scheduler_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetJobResponse:
        try:
            job = await self._scheduler.get(request.job_id, tenant=_scope())
        except OpenTinkerError as err:
            await abort_with(context, err)
        return scheduler_pb2.GetJobResponse(job=job)

    async def ListJobs(
        self, request: scheduler_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListJobsResponse:
        try:
            page = await self._scheduler.list_jobs(
                tenant=_scope(), page_size=request.page_size, page_token=request.page_token
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return scheduler_pb2.ListJobsResponse(jobs=page.jobs, next_page_token=page.next_page_token)

    async def CancelJob(
        self, request: scheduler_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.CancelJobResponse:
        try:
            job = await self._scheduler.cancel(request.job_id, request.reason, tenant=_scope())
        except OpenTinkerError as err:
            await abort_with(context, err)
        return scheduler_pb2.CancelJobResponse(job=job)

    async def WatchJob(
        self, request: scheduler_pb2.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.WatchJobResponse]:
        caller = current_principal()
        try:
            events = await self._scheduler.watch(
                request.job_id,
                request.from_seq,
                tenant=caller.tenant_scope,
                key_prefix=caller.key_prefix,
            )
            async for event in events:
                yield scheduler_pb2.WatchJobResponse(event=event)
        except OpenTinkerError as err:  # not found; or the key revoked while watching
            await abort_with(context, err)

    async def GetUsage(
        self, request: scheduler_pb2.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetUsageResponse:
        try:
            tenants = await self._scheduler.usage(
                tenant=_scope(), tenant_id=request.tenant_id, max_jobs=request.max_jobs
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return scheduler_pb2.GetUsageResponse(tenants=tenants)

    async def ListWorkers(
        self, request: scheduler_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListWorkersResponse:
        workers, next_token = await self._scheduler.overview.workers(
            tenant=_scope(), page_size=request.page_size, page_token=request.page_token
        )
        return scheduler_pb2.ListWorkersResponse(workers=workers, next_page_token=next_token)

    async def GetJobsProgress(
        self, request: scheduler_pb2.GetJobsProgressRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetJobsProgressResponse:
        try:
            steps = await self._scheduler.overview.last_steps(request.job_ids, tenant=_scope())
        except OpenTinkerError as err:
            await abort_with(context, err)
        return scheduler_pb2.GetJobsProgressResponse(last_step=steps)

    async def ReportJobProgress(
        self, request: scheduler_pb2.ReportJobProgressRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReportJobProgressResponse:
        s, job_id, attempt = self._scheduler, request.job_id, request.attempt
        await require_job(context, job_id, attempt)
        kind = request.WhichOneof("payload")
        try:
            if kind == "step":
                stop = await s.reports.step(
                    job_id, attempt, request.step, report_id=request.report_id
                )
            elif kind == "log":
                stop = await s.reports.log(job_id, attempt, request.log.message)
            elif kind == "failure":
                stop = await s.reports.failure(job_id, attempt, request.failure.reason)
            elif kind == "result":
                stop = await s.reports.result(job_id, attempt, request.result)
            elif kind == "row":
                stop = await s.reports.row(
                    job_id, attempt, request.row, report_id=request.report_id
                )
            elif kind == "session":
                stop = await s.reports.session(
                    job_id, attempt, request.session, report_id=request.report_id
                )
            else:
                raise ConfigError(
                    "payload: set one of step, log, failure, result, row or session",
                    reason="EMPTY_REPORT",
                )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return scheduler_pb2.ReportJobProgressResponse(stop=stop)

    async def ConnectWorker(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.ConnectWorkerRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.ConnectWorkerResponse]:
        try:
            first = await asyncio.wait_for(
                anext(request_iterator), timeout=self._scheduler.lease_ttl_s
            )
        except (TimeoutError, StopAsyncIteration):
            await abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the worker sent no `register` message in time; send it first",
            )
        session = await self._register(first, context)
        outgoing = _Envelopes()
        yield outgoing.next(
            registered=scheduler_pb2.WorkerRegistered(
                worker_id=session.worker_id,
                heartbeat_interval_s=self._scheduler.heartbeat_interval_s,
                lease_ttl_s=self._scheduler.lease_ttl_s,
            )
        )
        reader = asyncio.create_task(self._read_worker(session, request_iterator))
        end_reason = "stream ended"
        getter: asyncio.Future[WorkerCommand | None] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(session.outbox.get())
                # asyncio.wait, not wait_for: the latter can swallow the server's cancellation.
                done, _ = await asyncio.wait({getter}, timeout=self._scheduler.heartbeat_interval_s)
                if not done:
                    getter.cancel()
                    self._scheduler.check_credential_soon(session)  # admitted once: again
                    yield outgoing.next(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))
                    continue
                command = getter.result()
                if command is None:
                    break
                yield outgoing.next(**_command_fields(command))
                if isinstance(command, CloseCommand):
                    end_reason = command.reason
                    break
        finally:
            if getter is not None:
                getter.cancel()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            try:
                await self._scheduler.disconnect_worker(session, end_reason)
            except Exception:  # Redis away: the worker's leases lapse and are reclaimed later
                log.exception("worker_disconnect_failed", worker_id=session.worker_id)

    async def _register(
        self, first: scheduler_pb2.ConnectWorkerRequest, context: grpc.aio.ServicerContext
    ) -> WorkerSession:
        if not first.HasField("register"):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the first ConnectWorker message must be `register`, got "
                f"`{first.WhichOneof('payload')}`",
            )
        reg = first.register
        ids = [d.device_id for d in reg.devices]
        if not reg.worker_id:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "register.worker_id: set it")
        if "" in ids or len(set(ids)) != len(ids):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"register.devices: every device needs a unique, non-empty device_id; got {ids}",
            )
        devices = [DeviceOffer(d.device_id, d.kind, d.memory_bytes) for d in reg.devices]
        held = [
            HeldAttempt(h.job_id, h.attempt, h.lease_id, h.launched, h.exited) for h in reg.held
        ]
        ports = (reg.rendezvous_port_base, reg.rendezvous_port_count)
        if ports != (0, 0) and not (ports[0] > 0 and ports[1] > 0 and sum(ports) <= 65536):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "register.rendezvous_port_base/count: a range of TCP ports within 1..65535 "
                f"(or both 0 for the default), got base {ports[0]} count {ports[1]}",
            )
        try:  # one identity per worker token, one live stream per identity: before the ledger
            await self._scheduler.admit_worker(current_principal(), reg.worker_id)
            session = await self._scheduler.connect_worker(
                reg.worker_id, reg.hostname, devices, held
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        session.key_prefix = current_principal().key_prefix
        session.rendezvous_host = reg.rendezvous_host or reg.hostname
        if ports != (0, 0):
            session.rendezvous_ports = ports
        return session

    async def _read_worker(
        self,
        session: WorkerSession,
        request_iterator: AsyncIterator[scheduler_pb2.ConnectWorkerRequest],
    ) -> None:
        s = self._scheduler
        try:
            async for message in request_iterator:
                s.worker_seen(session)
                kind = message.WhichOneof("payload")
                try:
                    if kind == "launched":
                        m = message.launched
                        await s.job_launched(session, m.job_id, m.attempt)
                    elif kind == "exited":
                        m = message.exited
                        await s.job_exited(session, m.job_id, m.attempt, m.exit_code, m.reason)
                    elif kind == "waiting":
                        await self._job_waiting(session, message.waiting)
                    elif kind == "closing":
                        closing = message.closing  # jobs_stopped: nothing to drain
                        await s.disconnect_worker(
                            session,
                            closing.reason or "it closed its stream",
                            reclaim=True,
                            jobs_stopped=closing.jobs_stopped,
                            closing=True,
                        )
                        break
                except OpenTinkerError as err:  # one bad message does not end the session
                    log.warning(
                        "worker_message_refused", worker_id=session.worker_id, error=str(err)
                    )
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the stream broke (peer gone), or a launched/exited report
            # could not be stored (Redis away): the session ends below, the worker reconnects,
            # re-announces what it holds and re-sends its exits.
            log.info("worker_stream_broken", worker_id=session.worker_id, error=repr(err))
        session.end_stream()

    async def _job_waiting(self, session: WorkerSession, waiting: scheduler_pb2.JobWaiting) -> None:
        """A launch waits for devices that processes here still hold: said in the job's events
        when its current attempt is this worker's (a worker writes into no other job's)."""
        try:
            job = await self._scheduler.get(waiting.job_id, tenant=None)
            if job.attempt == waiting.attempt and holds_part(job, session.worker_id):
                log.info("job_waits_for_devices", job_id=job.job_id, worker_id=session.worker_id,
                         reason=waiting.reason)  # fmt: skip
                await self._scheduler.reports.log(job.job_id, job.attempt, waiting.reason[:1000])
        except Exception as err:  # informative only: a store error must not end the stream
            log.warning("job_waiting_not_recorded", job_id=waiting.job_id, error=repr(err))


class _Envelopes:
    """Numbers outgoing messages 1, 2, 3…"""

    def __init__(self) -> None:
        self._seq = 0

    def next(self, **payload: Any) -> scheduler_pb2.ConnectWorkerResponse:
        self._seq += 1
        return scheduler_pb2.ConnectWorkerResponse(seq=self._seq, **payload)


def _command_fields(command: WorkerCommand) -> dict[str, object]:
    if isinstance(command, LaunchCommand):
        return {
            "launch": scheduler_pb2.LaunchJob(
                job=command.job,
                lease_id=command.lease_id,
                device_ids=list(command.device_ids),
                job_token=command.job_token,
                rendezvous=_rendezvous(command.rendezvous),
                shared_host_id=command.host_id,
                shared_host_slots=command.host_slots,
            )
        }
    if isinstance(command, StopCommand):
        stop = scheduler_pb2.StopJob(
            job_id=command.job_id, reason=command.reason, attempt=command.attempt
        )
        return {"stop": stop}
    return {"closing": scheduler_pb2.SchedulerClosing(reason=command.reason)}


def _rendezvous(part: Rendezvous | None) -> scheduler_pb2.MultiNodeRendezvous | None:
    if part is None:
        return None
    return scheduler_pb2.MultiNodeRendezvous(
        master_addr=part.master_addr,
        master_port=part.master_port,
        world_size=part.world_size,
        rank_start=part.rank_start,
        node_rank=part.node_rank,
        num_nodes=part.num_nodes,
    )
