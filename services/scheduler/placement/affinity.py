"""LoRA affinity: offer a LoRA RL job first to the workers already running LoRA jobs of its
base model, where the node's shared rollout engine (worker/shared_rollouts.py) can take its
adapter instead of loading the base once more. Other jobs keep the workers' order.

The scheduler does not know an engine's capacity (a worker setting): a job sent to a worker
whose shared engine is full gets a private rollout there, as on any other worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentinker.common.v1 import common_pb2
from opentinker.services.scheduler.placement.worker_session import WorkerSession


def lora_base(job: common_pb2.Job) -> str:
    """The base model of a LoRA RL job, "" for any other job."""
    spec = job.spec
    if spec.kind != common_pb2.JOB_KIND_RL or spec.model.finetune != common_pb2.FINETUNE_MODE_LORA:
        return ""
    return spec.model.base_model


def by_lora_affinity(sessions: Sequence[WorkerSession], job: common_pb2.Job) -> list[WorkerSession]:
    """``sessions`` with those running most LoRA jobs of ``job``'s base model first (a stable
    order otherwise; unchanged for a job that is not LoRA RL)."""
    base = lora_base(job)
    if not base:
        return list(sessions)

    def sharing(session: WorkerSession) -> int:
        return sum(
            1 for key, b in session.lora_bases.items() if b == base and key in session.running
        )

    return sorted(sessions, key=sharing, reverse=True)
