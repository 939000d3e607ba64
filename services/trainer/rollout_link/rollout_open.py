"""Opening the job's rollout without leaving the user in silence: with vLLM a first start loads
the model, compiles it and captures CUDA graphs (a minute or more on a GPU: 42 s of engine init
for a 0.5B model on an H100) between RUNNING and the first step."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from opentinker.services.trainer.settings import TrainerSettings
from opentinker.spec import JobSpec


class Openable(Protocol):  # the RL loop's RolloutSession, inference's EvalRollout
    async def open(self, *, job_id: str, spec: JobSpec, timeout_s: float) -> str: ...


class LogReporter(Protocol):
    async def report_log(self, message: str) -> bool: ...


async def open_telling_the_user(
    rollout: Openable,
    reporter: LogReporter,
    *,
    job_id: str,
    spec: JobSpec,
    settings: TrainerSettings,
) -> str:
    """Open ``rollout`` for the job; returns its engine's name. An open still loading after
    ``settings.slow_open_notice_s`` is told in the job's events, and then how long it took."""
    started = time.monotonic()
    opening = asyncio.ensure_future(
        rollout.open(job_id=job_id, spec=spec, timeout_s=settings.open_timeout_s)
    )
    try:
        done, _ = await asyncio.wait({opening}, timeout=settings.slow_open_notice_s)
        if done:
            return opening.result()
        await reporter.report_log(
            f"the rollout is loading {spec.model.base_model} (with vLLM, a first start compiles "
            "the model and captures CUDA graphs: a minute or more)"
        )
        engine = await opening
    except BaseException:
        opening.cancel()
        raise
    await reporter.report_log(
        f"rollout ready: {engine} engine after {time.monotonic() - started:.0f} s"
    )
    return engine
