from opentinker.common.v1 import common_pb2 as _common_pb2
from opentinker.scheduler.v1 import identity_pb2 as _identity_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "request_id")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.JobSpec
    request_id: str
    def __init__(self, spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.Job
    def __init__(self, job: _Optional[_Union[_common_pb2.Job, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.Job
    def __init__(self, job: _Optional[_Union[_common_pb2.Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[_common_pb2.Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.Job
    def __init__(self, job: _Optional[_Union[_common_pb2.Job, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "from_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_seq: int
    def __init__(self, job_id: _Optional[str] = ..., from_seq: _Optional[int] = ...) -> None: ...

class WatchJobResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _common_pb2.JobEvent
    def __init__(self, event: _Optional[_Union[_common_pb2.JobEvent, _Mapping]] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("tenant_id", "max_jobs")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_JOBS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    max_jobs: int
    def __init__(self, tenant_id: _Optional[str] = ..., max_jobs: _Optional[int] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("device_seconds", "tokens_generated", "tokens_trained", "steps")
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    device_seconds: float
    tokens_generated: float
    tokens_trained: float
    steps: float
    def __init__(self, device_seconds: _Optional[float] = ..., tokens_generated: _Optional[float] = ..., tokens_trained: _Optional[float] = ..., steps: _Optional[float] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant_id", "period", "period_start_unix_s", "period_s", "total", "devices_in_use", "quota", "jobs")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    PERIOD_START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    period: Usage
    period_start_unix_s: float
    period_s: float
    total: Usage
    devices_in_use: int
    quota: _identity_pb2.TenantQuota
    jobs: _containers.RepeatedCompositeFieldContainer[JobUsage]
    def __init__(self, tenant_id: _Optional[str] = ..., period: _Optional[_Union[Usage, _Mapping]] = ..., period_start_unix_s: _Optional[float] = ..., period_s: _Optional[float] = ..., total: _Optional[_Union[Usage, _Mapping]] = ..., devices_in_use: _Optional[int] = ..., quota: _Optional[_Union[_identity_pb2.TenantQuota, _Mapping]] = ..., jobs: _Optional[_Iterable[_Union[JobUsage, _Mapping]]] = ...) -> None: ...

class JobUsage(_message.Message):
    __slots__ = ("job_id", "name", "state", "usage")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    state: _common_pb2.JobState
    usage: Usage
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.JobState, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ReportJobProgressRequest(_message.Message):
    __slots__ = ("job_id", "attempt", "report_id", "step", "log", "failure", "result", "row", "session")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    report_id: str
    step: _common_pb2.StepMetrics
    log: _common_pb2.LogLine
    failure: JobFailure
    result: JobResult
    row: _common_pb2.ResultRow
    session: SessionReport
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., report_id: _Optional[str] = ..., step: _Optional[_Union[_common_pb2.StepMetrics, _Mapping]] = ..., log: _Optional[_Union[_common_pb2.LogLine, _Mapping]] = ..., failure: _Optional[_Union[JobFailure, _Mapping]] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ..., row: _Optional[_Union[_common_pb2.ResultRow, _Mapping]] = ..., session: _Optional[_Union[SessionReport, _Mapping]] = ...) -> None: ...

class ReportJobProgressResponse(_message.Message):
    __slots__ = ("stop",)
    STOP_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    def __init__(self, stop: _Optional[bool] = ...) -> None: ...

class JobFailure(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SessionReport(_message.Message):
    __slots__ = ("endpoint", "ended_reason", "tokens_generated", "tokens_trained")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENDED_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    ended_reason: str
    tokens_generated: float
    tokens_trained: float
    def __init__(self, endpoint: _Optional[str] = ..., ended_reason: _Optional[str] = ..., tokens_generated: _Optional[float] = ..., tokens_trained: _Optional[float] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("checkpoint_uri", "final_metrics")
    class FinalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    FINAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    checkpoint_uri: str
    final_metrics: _containers.ScalarMap[str, float]
    def __init__(self, checkpoint_uri: _Optional[str] = ..., final_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("device_id", "kind", "memory_bytes")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    kind: str
    memory_bytes: int
    def __init__(self, device_id: _Optional[str] = ..., kind: _Optional[str] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class ConnectWorkerRequest(_message.Message):
    __slots__ = ("seq", "register", "heartbeat", "launched", "exited", "closing", "waiting")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LAUNCHED_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    seq: int
    register: RegisterWorker
    heartbeat: _common_pb2.Heartbeat
    launched: JobLaunched
    exited: JobExited
    closing: WorkerClosing
    waiting: JobWaiting
    def __init__(self, seq: _Optional[int] = ..., register: _Optional[_Union[RegisterWorker, _Mapping]] = ..., heartbeat: _Optional[_Union[_common_pb2.Heartbeat, _Mapping]] = ..., launched: _Optional[_Union[JobLaunched, _Mapping]] = ..., exited: _Optional[_Union[JobExited, _Mapping]] = ..., closing: _Optional[_Union[WorkerClosing, _Mapping]] = ..., waiting: _Optional[_Union[JobWaiting, _Mapping]] = ...) -> None: ...

class RegisterWorker(_message.Message):
    __slots__ = ("worker_id", "hostname", "devices", "held", "rendezvous_host", "rendezvous_port_base", "rendezvous_port_count")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_HOST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORT_BASE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORT_COUNT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    hostname: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    held: _containers.RepeatedCompositeFieldContainer[HeldAttempt]
    rendezvous_host: str
    rendezvous_port_base: int
    rendezvous_port_count: int
    def __init__(self, worker_id: _Optional[str] = ..., hostname: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., held: _Optional[_Iterable[_Union[HeldAttempt, _Mapping]]] = ..., rendezvous_host: _Optional[str] = ..., rendezvous_port_base: _Optional[int] = ..., rendezvous_port_count: _Optional[int] = ...) -> None: ...

class HeldAttempt(_message.Message):
    __slots__ = ("job_id", "attempt", "lease_id", "launched", "exited")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAUNCHED_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    lease_id: str
    launched: bool
    exited: bool
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., lease_id: _Optional[str] = ..., launched: _Optional[bool] = ..., exited: _Optional[bool] = ...) -> None: ...

class JobLaunched(_message.Message):
    __slots__ = ("job_id", "attempt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class JobExited(_message.Message):
    __slots__ = ("job_id", "attempt", "exit_code", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    exit_code: int
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class JobWaiting(_message.Message):
    __slots__ = ("job_id", "attempt", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class WorkerClosing(_message.Message):
    __slots__ = ("reason", "jobs_stopped")
    REASON_FIELD_NUMBER: _ClassVar[int]
    JOBS_STOPPED_FIELD_NUMBER: _ClassVar[int]
    reason: str
    jobs_stopped: bool
    def __init__(self, reason: _Optional[str] = ..., jobs_stopped: _Optional[bool] = ...) -> None: ...

class ConnectWorkerResponse(_message.Message):
    __slots__ = ("seq", "registered", "heartbeat", "launch", "stop", "closing")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    seq: int
    registered: WorkerRegistered
    heartbeat: _common_pb2.Heartbeat
    launch: LaunchJob
    stop: StopJob
    closing: SchedulerClosing
    def __init__(self, seq: _Optional[int] = ..., registered: _Optional[_Union[WorkerRegistered, _Mapping]] = ..., heartbeat: _Optional[_Union[_common_pb2.Heartbeat, _Mapping]] = ..., launch: _Optional[_Union[LaunchJob, _Mapping]] = ..., stop: _Optional[_Union[StopJob, _Mapping]] = ..., closing: _Optional[_Union[SchedulerClosing, _Mapping]] = ...) -> None: ...

class WorkerRegistered(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s", "lease_ttl_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    lease_ttl_s: float
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class LaunchJob(_message.Message):
    __slots__ = ("job", "lease_id", "device_ids", "job_token", "rendezvous", "shared_host_id", "shared_host_slots")
    JOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    JOB_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    SHARED_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.Job
    lease_id: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    job_token: str
    rendezvous: MultiNodeRendezvous
    shared_host_id: str
    shared_host_slots: int
    def __init__(self, job: _Optional[_Union[_common_pb2.Job, _Mapping]] = ..., lease_id: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ..., job_token: _Optional[str] = ..., rendezvous: _Optional[_Union[MultiNodeRendezvous, _Mapping]] = ..., shared_host_id: _Optional[str] = ..., shared_host_slots: _Optional[int] = ...) -> None: ...

class MultiNodeRendezvous(_message.Message):
    __slots__ = ("master_addr", "master_port", "world_size", "rank_start", "node_rank", "num_nodes")
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_START_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    master_addr: str
    master_port: int
    world_size: int
    rank_start: int
    node_rank: int
    num_nodes: int
    def __init__(self, master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_start: _Optional[int] = ..., node_rank: _Optional[int] = ..., num_nodes: _Optional[int] = ...) -> None: ...

class StopJob(_message.Message):
    __slots__ = ("job_id", "reason", "attempt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    attempt: int
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class SchedulerClosing(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "next_page_token")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    next_page_token: str
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "hostname", "devices", "last_seen_s_ago", "lost")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_AGO_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    hostname: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceStatus]
    last_seen_s_ago: float
    lost: bool
    def __init__(self, worker_id: _Optional[str] = ..., hostname: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceStatus, _Mapping]]] = ..., last_seen_s_ago: _Optional[float] = ..., lost: _Optional[bool] = ...) -> None: ...

class DeviceStatus(_message.Message):
    __slots__ = ("device_id", "kind", "memory_bytes", "leased", "lease_id", "job_id", "leased_since_unix_s", "draining", "draining_since_unix_s", "shared_host_id", "hosted_sessions", "host_slots")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASED_SINCE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_SINCE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SHARED_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    kind: str
    memory_bytes: int
    leased: bool
    lease_id: str
    job_id: str
    leased_since_unix_s: float
    draining: bool
    draining_since_unix_s: float
    shared_host_id: str
    hosted_sessions: int
    host_slots: int
    def __init__(self, device_id: _Optional[str] = ..., kind: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., leased: _Optional[bool] = ..., lease_id: _Optional[str] = ..., job_id: _Optional[str] = ..., leased_since_unix_s: _Optional[float] = ..., draining: _Optional[bool] = ..., draining_since_unix_s: _Optional[float] = ..., shared_host_id: _Optional[str] = ..., hosted_sessions: _Optional[int] = ..., host_slots: _Optional[int] = ...) -> None: ...

class GetJobsProgressRequest(_message.Message):
    __slots__ = ("job_ids",)
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetJobsProgressResponse(_message.Message):
    __slots__ = ("last_step",)
    class LastStepEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.StepMetrics
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.StepMetrics, _Mapping]] = ...) -> None: ...
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    last_step: _containers.MessageMap[str, _common_pb2.StepMetrics]
    def __init__(self, last_step: _Optional[_Mapping[str, _common_pb2.StepMetrics]] = ...) -> None: ...
