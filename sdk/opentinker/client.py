"""The Python client of an OpenTinker scheduler.

    import opentinker
    with opentinker.Client("127.0.0.1:50051", api_key="otk_…") as client:  # or $OPENTINKER_API_KEY
        job = client.fit(opentinker.JobSpec(rl=opentinker.RlConfig(env_name="letter")))

Every call takes keyword-only options and a ``timeout=`` (seconds) and raises a typed
``opentinker.errors`` exception carrying the gRPC status code.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from opentinker.catalog import ModelInfo
from opentinker.connection import Connection
from opentinker.errors import ConfigError, JobFailedError, OpenTinkerError, from_rpc_error
from opentinker.jobs import JobEvent, JobInfo, StepProgress
from opentinker.scheduler.v1 import (
    identity_pb2,
    identity_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from opentinker.session_config import SessionConfig
from opentinker.sinks import MetricSink, close_all, write_all
from opentinker.spec import JobSpec, LoraConfig, ModelSpec, to_proto
from opentinker.training_session import TrainingSession, wait_until_serving

DEFAULT_ADDRESS = "127.0.0.1:50051"


class Client:
    """A connection to one scheduler. Thread-safe; close it (or use ``with``) when done."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        ca_file: str | Path | None = None,
    ) -> None:
        """``api_key``: your OpenTinker API key (default: ``$OPENTINKER_API_KEY``); every call
        carries it. Without one, calls fail with AuthenticationError (UNAUTHENTICATED).
        ``ca_file``: the CA of a scheduler serving TLS (default ``$OPENTINKER_TLS_CA_FILE``)."""
        self._conn = Connection(address, api_key=api_key, timeout=timeout, ca_file=ca_file)
        self._api_key = api_key
        self.address, self.timeout = address, timeout
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._conn.channel)
        self._identity = identity_pb2_grpc.IdentityServiceStub(self._conn.channel)
        self._models = models_pb2_grpc.ModelServiceStub(self._conn.channel)
        self._call = self._conn.call

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def whoami(self, *, timeout: float | None = None) -> identity_pb2.Principal:
        """Who the API key says you are: tenant, user, role."""
        reply = self._call(self._identity.WhoAmI, identity_pb2.WhoAmIRequest(), timeout)
        return reply.principal

    def usage(
        self, *, tenant_id: str = "", max_jobs: int = 20, timeout: float | None = None
    ) -> list[scheduler_pb2.TenantUsage]:
        """Device-seconds, tokens and steps of your tenant (admins: of ``tenant_id`` or every
        tenant) this budget period and in all, its quota, and its newest jobs' usage."""
        request = scheduler_pb2.GetUsageRequest(tenant_id=tenant_id, max_jobs=max_jobs)
        return list(self._call(self._stub.GetUsage, request, timeout).tenants)

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The pool's models (the scheduler's catalog), by name. Empty: the pool lists none,
        and a job may name any model the workers can load."""
        request = models_pb2.ListModelsRequest(page_size=100)
        models = self._conn.pages(self._models.ListModels, request, "models", timeout)
        return [ModelInfo.from_proto(m) for m in models]

    def register_model(self, model: ModelInfo, *, timeout: float | None = None) -> ModelInfo:
        """Add ``model`` to the catalog, or replace the one of its name (an admin's key;
        PermissionDeniedError otherwise); returns it as stored."""
        request = models_pb2.RegisterModelRequest(model=model.to_proto())
        return ModelInfo.from_proto(self._call(self._models.RegisterModel, request, timeout).model)

    def remove_model(self, name: str, *, timeout: float | None = None) -> None:
        """Take ``name`` out of the catalog (an admin's key); NotFoundError if it is not in."""
        self._call(self._models.RemoveModel, models_pb2.RemoveModelRequest(name=name), timeout)

    def submit(
        self, spec: JobSpec, *, request_id: str | None = None, timeout: float | None = None
    ) -> JobInfo:
        """Queue a job. Retrying with the same ``request_id`` returns the first job."""
        request = scheduler_pb2.SubmitJobRequest(
            spec=to_proto(spec), request_id=request_id or uuid.uuid4().hex
        )
        return JobInfo.from_proto(self._call(self._stub.SubmitJob, request, timeout).job)

    def get_job(self, job_id: str, *, timeout: float | None = None) -> JobInfo:
        request = scheduler_pb2.GetJobRequest(job_id=job_id)
        return JobInfo.from_proto(self._call(self._stub.GetJob, request, timeout).job)

    def list_jobs(self, *, page_size: int = 50, timeout: float | None = None) -> Iterator[JobInfo]:
        """Every job, newest first, fetched page by page."""
        request = scheduler_pb2.ListJobsRequest(page_size=page_size)
        for job in self._conn.pages(self._stub.ListJobs, request, "jobs", timeout):
            yield JobInfo.from_proto(job)

    def workers(self, *, timeout: float | None = None) -> list[scheduler_pb2.WorkerStatus]:
        """Connected workers with their devices; a lease shows its job only to its tenant."""
        request = scheduler_pb2.ListWorkersRequest(page_size=100)
        return list(self._conn.pages(self._stub.ListWorkers, request, "workers", timeout))

    def jobs_progress(
        self, job_ids: list[str], *, timeout: float | None = None
    ) -> dict[str, StepProgress]:
        """The last step of each of your jobs among ``job_ids`` (at most 500) that has one."""
        request = scheduler_pb2.GetJobsProgressRequest(job_ids=job_ids)
        reply = self._call(self._stub.GetJobsProgress, request, timeout)
        return {job_id: StepProgress.from_proto(s) for job_id, s in reply.last_step.items()}

    def cancel(self, job_id: str, *, reason: str = "", timeout: float | None = None) -> JobInfo:
        request = scheduler_pb2.CancelJobRequest(
            job_id=job_id, reason=reason or "cancelled by user"
        )
        return JobInfo.from_proto(self._call(self._stub.CancelJob, request, timeout).job)

    def watch(
        self,
        job_id: str,
        *,
        from_seq: int = 1,
        timeout: float | None = None,
        reconnect_for: float = 120.0,
    ) -> Iterator[JobEvent]:
        """A job's events from ``from_seq`` on, live, ending after its terminal state.

        ``timeout`` bounds the whole watch (default: none — a training run may take hours).
        While the scheduler is unreachable (a restart, its Redis away) the watch reconnects
        and resumes after the last event it yielded, for up to ``reconnect_for`` seconds in a
        row; nothing is missed or repeated.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        next_seq, away_since = from_seq, None
        connected = _Connected(self._conn.channel)  # a quiet job sends no events for hours
        try:
            while True:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
                request = scheduler_pb2.WatchJobRequest(job_id=job_id, from_seq=next_seq)
                try:
                    for response in self._stub.WatchJob(request, timeout=left):
                        event = JobEvent.from_proto(response.event)
                        next_seq, away_since = event.seq + 1, None
                        yield event
                        if event.terminal:
                            return
                    return  # the server ended the stream without a terminal event
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise from_rpc_error(err) from None
                    if away_since is None or connected.since(away_since):  # a new outage
                        away_since = time.monotonic()
                    if time.monotonic() - away_since > reconnect_for:
                        raise from_rpc_error(err) from None
                time.sleep(min(1.0, reconnect_for / 10))
        finally:
            connected.close()

    def training_session(
        self,
        *,
        base_model: str,
        lora_rank: int | None = 8,
        lora: LoraConfig | None = None,
        name: str = "session",
        session: SessionConfig | None = None,
        wait_timeout: float = 600.0,
        timeout: float | None = None,
    ) -> TrainingSession:
        """Start a training session job and connect to it once it runs.

        ``lora_rank=None`` trains every parameter; ``lora``: the whole LoRA config (rank,
        alpha, target modules) instead of ``lora_rank``. The session holds a device until
        you close it (or use ``with``) or it is idle for ``session.idle_timeout_s``.
        ``wait_timeout``:
        seconds to wait for a device and the model load; ``timeout``: per call (default the
        client's)."""
        model = (
            ModelSpec(base_model=base_model, finetune="full")
            if lora_rank is None and lora is None
            else ModelSpec(base_model=base_model, lora=lora or LoraConfig(rank=lora_rank or 8))
        )
        spec = JobSpec(name=name, kind="session", model=model, session=session or SessionConfig())
        job = self.submit(spec)

        def cancel_unless_done() -> None:
            try:
                if not self.get_job(job.job_id).done:
                    self.cancel(job.job_id, reason="session client closed")
            except OpenTinkerError:
                pass  # the scheduler is away; the idle timeout will end the session

        try:
            job = wait_until_serving(self.get_job, job.job_id, timeout=wait_timeout)
        except BaseException:
            cancel_unless_done()
            raise

        def wait_until_done() -> None:  # the job has ended and released its device
            deadline = time.monotonic() + self.timeout
            while not self.get_job(job.job_id).done and time.monotonic() < deadline:
                time.sleep(0.1)

        return TrainingSession(
            job, api_key=self._api_key, timeout=timeout or self.timeout, on_close=wait_until_done
        )

    def fit(
        self,
        spec: JobSpec,
        *,
        on_event: Callable[[JobEvent], None] | None = None,
        sinks: Sequence[MetricSink] = (),
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> JobInfo:
        """Submit a job and follow it to the end; the trainer drives everything server-side.

        ``on_event`` sees every state change and step metric as it happens; each of ``sinks``
        (``opentinker.sinks``: jsonl, TensorBoard, W&B offline) records them and is closed when
        the watch ends. Returns the finished job; raises JobFailedError (with the reason) if it
        FAILED or was CANCELLED.
        """
        job = self.submit(spec, request_id=request_id)
        try:
            for event in self.watch(job.job_id, timeout=timeout):
                write_all(list(sinks), event)
                if on_event is not None:
                    on_event(event)
        finally:
            close_all(list(sinks))
        return self._succeeded(job.job_id)

    def infer(
        self,
        spec: JobSpec,
        *,
        on_submit: Callable[[JobInfo], None] | None = None,
        on_event: Callable[[JobEvent], None] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Submit an inference job (``spec.kind == "inference"``) now; returns an iterator
        over its result rows, one per episode, as they arrive (fields: common.proto ResultRow).
        ``on_submit`` sees the queued job. The iterator raises JobFailedError (with the reason)
        unless the job SUCCEEDED; ``opentinker.inference_rows.summarize(rows)`` gives the
        summary the job reports.
        """
        if spec.kind != "inference":
            raise ConfigError(f"infer() runs inference jobs; this spec's kind is {spec.kind!r}")
        job = self.submit(spec, request_id=request_id)
        if on_submit is not None:
            on_submit(job)
        return self.results(job.job_id, on_event=on_event, timeout=timeout)

    def results(
        self,
        job_id: str,
        *,
        on_event: Callable[[JobEvent], None] | None = None,
        timeout: float | None = None,
    ) -> Iterator[dict[str, Any]]:
        """An inference job's result rows from the first on, live (a late caller replays
        them all), once each even when a retried attempt played an episode again (an episode
        keeps its id across attempts; its samples and roles have rows of their own). Raises
        JobFailedError unless the job SUCCEEDED."""
        seen: set[tuple[int, str, str]] = set()
        for event in self.watch(job_id, timeout=timeout):
            if on_event is not None:
                on_event(event)
            if event.kind != "row":
                continue
            row = event.row
            key = (row["index"], row.get("episode_id", ""), row.get("role", ""))
            if key not in seen:
                seen.add(key)
                yield row
        self._succeeded(job_id)

    def _succeeded(self, job_id: str) -> JobInfo:
        """The finished job; JobFailedError (with the reason) unless it SUCCEEDED."""
        final = self.get_job(job_id)
        if final.state != "SUCCEEDED":
            raise JobFailedError(
                f"job {final.job_id} ended {final.state}: {final.reason}",
                code=final.state,
                reason=final.reason,
            )
        return final


class _Connected:
    """When ``channel`` last reached the scheduler (READY): a watch reconnected after an
    outage may then wait quietly for hours, and the next outage is a new one."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel, self._last = channel, 0.0
        channel.subscribe(self._saw, try_to_connect=False)

    def _saw(self, state: grpc.ChannelConnectivity) -> None:
        if state == grpc.ChannelConnectivity.READY:
            self._last = time.monotonic()

    def since(self, moment: float) -> bool:
        return self._last > moment

    def close(self) -> None:
        self._channel.unsubscribe(self._saw)
