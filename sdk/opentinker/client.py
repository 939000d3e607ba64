"""The Python client of an OpenTinker scheduler.

    import opentinker
    with opentinker.Client("127.0.0.1:50051") as client:
        job = client.fit(opentinker.JobSpec(rl=opentinker.RlConfig(env_name="letter")))

Every call takes keyword-only options and a ``timeout=`` (seconds) and raises a typed
``opentinker.errors`` exception carrying the gRPC status code.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import grpc

from opentinker.errors import JobFailedError, from_rpc_error
from opentinker.jobs import JobEvent, JobInfo
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.spec import JobSpec, to_proto

DEFAULT_ADDRESS = "127.0.0.1:50051"

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class Client:
    """A connection to one scheduler. Thread-safe; close it (or use ``with``) when done."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float = 30.0) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

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
        token = ""
        while True:
            request = scheduler_pb2.ListJobsRequest(page_size=page_size, page_token=token)
            response = self._call(self._stub.ListJobs, request, timeout)
            yield from (JobInfo.from_proto(j) for j in response.jobs)
            token = response.next_page_token
            if not token:
                return

    def cancel(self, job_id: str, *, reason: str = "", timeout: float | None = None) -> JobInfo:
        request = scheduler_pb2.CancelJobRequest(
            job_id=job_id, reason=reason or "cancelled by user"
        )
        return JobInfo.from_proto(self._call(self._stub.CancelJob, request, timeout).job)

    def watch(
        self, job_id: str, *, from_seq: int = 1, timeout: float | None = None
    ) -> Iterator[JobEvent]:
        """A job's events from ``from_seq`` on, live, ending after its terminal state.

        ``timeout`` bounds the whole watch (default: none — a training run may take hours).
        """
        request = scheduler_pb2.WatchJobRequest(job_id=job_id, from_seq=from_seq)
        try:
            for response in self._stub.WatchJob(request, timeout=timeout):
                event = JobEvent.from_proto(response.event)
                yield event
                if event.terminal:
                    return
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def fit(
        self,
        spec: JobSpec,
        *,
        on_event: Callable[[JobEvent], None] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> JobInfo:
        """Submit a job and follow it to the end; the trainer drives everything server-side.

        ``on_event`` sees every state change and step metric as it happens. Returns the
        finished job; raises JobFailedError (with the reason) if it FAILED or was CANCELLED.
        """
        job = self.submit(spec, request_id=request_id)
        for event in self.watch(job.job_id, timeout=timeout):
            if on_event is not None:
                on_event(event)
        final = self.get_job(job.job_id)
        if final.state != "SUCCEEDED":
            raise JobFailedError(
                f"job {final.job_id} ended {final.state}: {final.reason}",
                code=final.state,
                reason=final.reason,
            )
        return final
