"""An inference job: the rollout plays the episodes, this driver reports one row per episode.

The trainer process runs it instead of the RL loop when the job's kind is "inference". The
rollout loads the model (base, full checkpoint, or base + adapter) and plays the episodes
through EnvHub with the same AgentLoop as training, ``concurrency`` at a time; every episode
becomes a result row in the job's event stream, and the job's result carries the summary that
``opentinker infer`` prints (mean_reward, accuracy, mean_turns, env_errors, episodes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import structlog

from opentinker.errors import EnvironmentError_, OpenTinkerError
from opentinker.eval_stats import pass_at_k
from opentinker.inference_rows import ENV_ERROR, summarize
from opentinker.services.common.env_errors import (
    EnvErrorTally,
    env_error_line,
    over_fraction,
    tally,
)
from opentinker.services.trainer.reporter import report_failure_logged
from opentinker.services.trainer.rl.loop import Outcome
from opentinker.services.trainer.rl.validation import EvalRollout
from opentinker.services.trainer.rollout_link.rollout_open import open_telling_the_user
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.spec import InferenceConfig, JobSpec

log = structlog.get_logger()


class InferenceRollout(EvalRollout, Protocol):
    async def open(self, *, job_id: str, spec: JobSpec, timeout_s: float) -> str: ...

    async def close(self, *, reason: str, timeout_s: float) -> None: ...


class RowReporter(Protocol):
    async def report_row(self, row: Mapping[str, Any]) -> bool: ...

    async def report_log(self, message: str) -> bool: ...

    async def report_result(
        self, checkpoint_uri: str, final_metrics: Mapping[str, float]
    ) -> None: ...

    async def report_failure(self, reason: str) -> None: ...


class InferenceJob:
    """Runs one inference job to its end; ``run`` reports a failure itself and returns the
    Outcome (FAILED when more than max_env_error_fraction of the episodes failed in the
    environment, or the rollout failed)."""

    def __init__(
        self,
        *,
        job_id: str,
        spec: JobSpec,
        rollout: InferenceRollout,
        reporter: RowReporter,
        settings: TrainerSettings,
    ) -> None:
        if spec.inference is None:
            raise ValueError("InferenceJob needs an inference job spec")
        self.job_id, self.spec = job_id, spec
        self.config: InferenceConfig = spec.inference
        self.rollout, self.reporter, self.settings = rollout, reporter, settings
        self.rows: list[dict[str, Any]] = []
        self.log = log.bind(job_id=job_id, env=self.config.env_name)

    async def run(self) -> Outcome:
        reason = ""
        try:
            outcome = await self._play()
        except OpenTinkerError as err:
            outcome, reason = Outcome.FAILED, str(err)
        except Exception as err:  # a bug: still a reported, clean failure
            self.log.exception("inference_crashed")
            outcome, reason = Outcome.FAILED, f"inference error: {type(err).__name__}: {err}"
        finally:
            await self.rollout.close(
                reason="inference finished", timeout_s=self.settings.close_timeout_s
            )
        if outcome is Outcome.FAILED:
            await report_failure_logged(
                self.reporter, reason, self.log, episodes_done=len(self.rows)
            )
        return outcome

    async def _play(self) -> Outcome:
        c = self.config
        engine = await open_telling_the_user(
            self.rollout, self.reporter, job_id=self.job_id, spec=self.spec, settings=self.settings
        )
        self.log.info("inference_started", engine=engine, episodes=c.episodes)
        temperature = 0.0 if c.greedy else c.sampling.temperature
        samples = c.samples_per_episode  # each episode's samples are played in one batch
        per_batch = max(1, c.concurrency // samples)
        for batch_index, first in enumerate(range(0, c.episodes, per_batch)):
            rows = await self.rollout.evaluate(
                batch_index=batch_index,
                first_episode=first,
                episodes=min(per_batch, c.episodes - first),
                temperature=temperature,
                timeout_s=self.settings.collect_timeout_s,
                samples=samples,
            )
            for row in rows:
                self.rows.append(row)
                if await self.reporter.report_row(row):
                    self.log.info("job_cancelled", episodes_done=len(self.rows))
                    return Outcome.CANCELLED
            await self._tell_env_errors(rows, batch_index)
        if all(r["finish_reason"] == ENV_ERROR for r in self.rows):
            raise EnvironmentError_(
                f"every one of {len(self.rows)} episodes of env {c.env_name!r} failed "
                f"(first error: {self.rows[0]['finish_detail'] or 'no detail given'}); "
                "check the environment server"
            )
        errors = rows_env_errors(self.rows)
        if failure := over_fraction(c.env_name, errors, c.max_env_error_fraction, "in all"):
            raise EnvironmentError_(failure)
        summary = summarize(self.rows).metrics()
        if samples > 1:  # several samples of each episode: pass@k, as `opentinker eval` prints
            for k in sorted({1, samples}):
                summary[f"pass@{k}"] = pass_at_k(self.rows, k) or 0.0
        await self.reporter.report_result("", summary)
        self.log.info("job_succeeded", **summary)
        return Outcome.SUCCEEDED

    async def _tell_env_errors(self, rows: list[dict[str, Any]], batch_index: int) -> None:
        """A line in the job's event stream for a batch of rows with env errors."""
        errors = rows_env_errors(rows)
        if errors.errors:
            line = env_error_line(self.config.env_name, f"in batch {batch_index + 1}", errors)
            self.log.warning("env_errors", message=line)
            await self.reporter.report_log(line)


def rows_env_errors(rows: list[dict[str, Any]]) -> EnvErrorTally:
    """The env errors of result rows (their kinds, the first reason)."""
    failed = [r["finish_detail"] for r in rows if r["finish_reason"] == ENV_ERROR]
    return tally(failed, len(rows))
