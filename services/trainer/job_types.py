"""What a trainer job's loop (RL or SFT) works with and ends in: the rollout it drives and the
reporter it reports through (small Protocols, implemented over gRPC in rollout_client.py and
reporter.py), the status GetTrainerStatus answers, and the outcome."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from opentinker.spec import JobSpec

from .batch import CollectedBatch
from .pipeline import BatchSource
from .validation import EvalRollout
from .weight_sync import WeightReceiver


class RolloutSession(EvalRollout, BatchSource, WeightReceiver, Protocol):
    roles: tuple[str, ...]  # the env's roles once open (multi-agent self-play); () = one agent

    async def open(self, *, job_id: str, spec: JobSpec, timeout_s: float) -> str: ...

    async def collect(
        self, *, batch_index: int, num_groups: int, group_size: int, timeout_s: float
    ) -> CollectedBatch: ...

    async def close(self, *, reason: str, timeout_s: float) -> None: ...


class ProgressReporter(Protocol):
    async def report_step(
        self, step: int, policy_version: int, metrics: Mapping[str, float]
    ) -> bool: ...

    async def report_result(
        self, checkpoint_uri: str, final_metrics: Mapping[str, float]
    ) -> None: ...

    async def report_failure(self, reason: str) -> None: ...

    async def report_log(self, message: str) -> bool: ...


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass
class TrainerStatus:
    """What GetTrainerStatus answers; the loop updates it after every step."""

    job_id: str
    finetune: str
    trainable_parameters: int = 0
    step: int = 0
    policy_version: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
