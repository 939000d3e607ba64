"""What a trainer job's loop (RL or SFT) works with and ends in: the rollout it drives and the
reporter it reports through (small Protocols, implemented over gRPC in rollout_client.py and
reporter.py), the status GetTrainerStatus answers, and the outcome."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from opentinker.services.common.exit_codes import RETRY_LATER
from opentinker.services.trainer.rl.batch import CollectedBatch
from opentinker.services.trainer.rl.pipeline import BatchSource
from opentinker.services.trainer.rl.validation import EvalRollout
from opentinker.services.trainer.rollout_link.weight_sync import WeightReceiver
from opentinker.spec import JobSpec


class RolloutSession(EvalRollout, BatchSource, WeightReceiver, Protocol):
    roles: tuple[str, ...]  # the env's roles once open (multi-agent self-play); () = one agent

    async def open(self, *, job_id: str, spec: JobSpec, timeout_s: float) -> str: ...

    async def collect(
        self, *, batch_index: int, num_groups: int, group_size: int, timeout_s: float
    ) -> CollectedBatch: ...

    async def close(self, *, reason: str, timeout_s: float) -> None: ...


class ProgressReporter(Protocol):
    async def report_step(
        self,
        step: int,
        policy_version: int,
        metrics: Mapping[str, float],
        env_error_reason: str = "",
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
    RETRY_LATER = "retry later"  # a storage fault, on_storage_error = "requeue"

    @property
    def exit_code(self) -> int:
        """The trainer process's exit code for this outcome (services/common/exit_codes.py)."""
        if self is Outcome.RETRY_LATER:
            return RETRY_LATER
        return 1 if self is Outcome.FAILED else 0


def after_storage_fault(reason: str, *, on_storage_error: str) -> tuple[Outcome, str]:
    """How a job ends when its checkpoint root fails it (a StorageError's ``reason``), as the
    operator chose (TrainerSettings.on_storage_error): FAILED, or RETRY_LATER (re-queued)."""
    if on_storage_error == "requeue":
        why = f"{reason}; this attempt ends and the job is re-queued (on_storage_error=requeue)"
        return Outcome.RETRY_LATER, why
    return Outcome.FAILED, reason


@dataclass
class TrainerStatus:
    """What GetTrainerStatus answers; the loop updates it after every step."""

    job_id: str
    finetune: str
    trainable_parameters: int = 0
    step: int = 0
    policy_version: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
