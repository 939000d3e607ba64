"""Plain views of jobs and job events, as the SDK returns them (no protobuf in user code)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from opentinker.common.v1 import common_pb2

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


def state_name(state: int) -> str:
    """common_pb2.JobState value -> "QUEUED", "RUNNING", ..."""
    return common_pb2.JobState.Name(state).removeprefix("JOB_STATE_")


# The final_metrics key of each kind's reward: RL (trainer/rl/loop.py, mean of the last 10
# steps) and inference (inference_rows.InferenceSummary.metrics).
RL_FINAL_REWARD = "reward_mean_last10"
FINAL_REWARD_METRICS = (RL_FINAL_REWARD, "mean_reward")


@dataclass(frozen=True)
class JobInfo:
    """A job as the scheduler reports it."""

    job_id: str
    name: str
    state: str  # QUEUED | ALLOCATING | RUNNING | SUCCEEDED | FAILED | CANCELLED
    reason: str
    attempt: int
    worker_id: str
    checkpoint_uri: str
    created_unix_s: float
    updated_unix_s: float
    final_metrics: dict[str, float] = field(default_factory=dict)
    endpoint: str = ""  # a session job's trainer (host:port) while it runs
    tenant_id: str = ""
    kind: str = ""  # RL | SFT | INFERENCE | SESSION
    step_budget: int = 0  # the optimizer steps the spec asks for (RL/SFT); 0 = not known
    queue_position: int = 0  # while QUEUED: 1 = placed next; 0 in any other state
    queue_reason: str = ""  # while QUEUED: why it is not placed yet

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def final_reward(self) -> float | None:
        """The reward a finished job reports: an RL job's mean over its last steps, an
        inference job's mean over its episodes; None for other kinds or before the end."""
        for key in FINAL_REWARD_METRICS:
            if key in self.final_metrics:
                return self.final_metrics[key]
        return None

    @classmethod
    def from_proto(cls, job: common_pb2.Job) -> JobInfo:
        return cls(
            job_id=job.job_id,
            name=job.spec.name,
            state=state_name(job.state),
            reason=job.reason,
            attempt=job.attempt,
            worker_id=job.worker_id,
            checkpoint_uri=job.checkpoint_uri,
            created_unix_s=job.created_unix_s,
            updated_unix_s=job.updated_unix_s,
            final_metrics=dict(job.final_metrics),
            endpoint=job.endpoint,
            tenant_id=job.tenant_id,
            kind=common_pb2.JobKind.Name(job.spec.kind).removeprefix("JOB_KIND_"),
            step_budget=job.spec.sft.steps if job.spec.HasField("sft") else job.spec.rl.steps,
            queue_position=job.queue_position,
            queue_reason=job.queue_reason,
        )


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's event stream.

    kind "state": ``state``/``reason`` set; kind "step": ``step``, ``policy_version`` and
    ``metrics`` (seconds for ``time_*``, per second for rates), ``env_error_reason`` (the
    step's first env error, '' when none); kind "log": ``message``;
    kind "row": ``row``, one episode of an inference job (fields: common.proto ResultRow).
    """

    seq: int
    time_unix_s: float
    kind: str
    state: str = ""
    reason: str = ""
    step: int = 0
    policy_version: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    env_error_reason: str = ""

    @property
    def terminal(self) -> bool:
        return self.kind == "state" and self.state in TERMINAL_STATES

    @classmethod
    def from_proto(cls, ev: common_pb2.JobEvent) -> JobEvent:
        which = ev.WhichOneof("payload")
        seq, at = ev.seq, ev.time_unix_s
        if which == "state_change":
            return cls(
                seq,
                at,
                kind="state",
                state=state_name(ev.state_change.state),
                reason=ev.state_change.reason,
            )
        if which == "step":
            return cls(
                seq,
                at,
                kind="step",
                step=ev.step.step,
                policy_version=ev.step.policy_version,
                metrics=dict(ev.step.metrics),
                env_error_reason=ev.step.env_error_reason,
            )
        if which == "row":
            return cls(seq, at, kind="row", row=json.loads(ev.row.json))
        return cls(seq, at, kind="log", message=ev.log.message if which == "log" else "")


@dataclass(frozen=True)
class StepProgress:
    """The last step a job reported: its number, weights version and metrics."""

    step: int
    policy_version: int
    metrics: dict[str, float]

    @classmethod
    def from_proto(cls, step: common_pb2.StepMetrics) -> StepProgress:
        return cls(step.step, step.policy_version, dict(step.metrics))
