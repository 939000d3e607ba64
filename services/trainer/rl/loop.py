"""The managed RL loop: collect -> advantages -> loss -> step -> sync weights -> report.

With ``max_staleness`` >= 1 the rollout already plays the next batch(es) while the trainer
trains (pipeline.py); progress reports go out in the background (step_reports.py).

Knows nothing of gRPC: it drives a ``RolloutSession`` and a ``ProgressReporter`` (small
Protocols, implemented over gRPC in rollout_client.py and reporter.py). Model work runs in a
worker thread so the process's gRPC server stays responsive during a step.
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import structlog

from opentinker.errors import EnvironmentError_, OpenTinkerError
from opentinker.jobs import RL_FINAL_REWARD
from opentinker.services.common.env_stats import TruncationWatch
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.errors import CheckpointError
from opentinker.services.trainer.job_types import (
    Outcome,
    ProgressReporter,
    RolloutSession,
    TrainerStatus,
    after_storage_fault,
)
from opentinker.services.trainer.model.memory_metrics import memory_metrics
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.model.schedule import lr_factor
from opentinker.services.trainer.parallel.distributed import group_broke
from opentinker.services.trainer.parallel.ranks import LeaderPolicy
from opentinker.services.trainer.reporter import report_failure_logged
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.batch_work import UpdateConfig
from opentinker.services.trainer.rl.critic import Critic
from opentinker.services.trainer.rl.env_error_watch import EnvErrorWatch
from opentinker.services.trainer.rl.pipeline import BatchPipeline, usable_episodes
from opentinker.services.trainer.rl.reference import ReferencePolicy
from opentinker.services.trainer.rl.role_training import adopt_roles, role_update
from opentinker.services.trainer.rl.step_metrics import StepTimes, step_metrics
from opentinker.services.trainer.rl.step_reports import BackgroundStepReports
from opentinker.services.trainer.rl.training import TrainStats, rl_update
from opentinker.services.trainer.rl.validation import Validation
from opentinker.services.trainer.rollout_link.rollout_open import open_telling_the_user
from opentinker.services.trainer.rollout_link.weight_sync import (
    ProbeShift,
    ProbeShiftWatch,
    SyncResult,
    verified_sync,
)
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.services.trainer.storage import StorageError
from opentinker.spec import JobSpec, RlConfig

log = structlog.get_logger()

REWARD_WINDOW = 10  # steps in the moving reward mean used by stop_at_reward and final metrics


class RlLoop:
    """Runs one RL job to its end. ``run`` reports the failure itself and never raises
    OpenTinkerError; it returns the Outcome.

    Checkpoints go to ``checkpoint_dir`` (default ``<run_dir>/checkpoints``); the worker gives
    every attempt of a job the same folder, and the loop starts from its last complete
    checkpoint (see checkpoints.py), so a re-attempt continues where the last one saved.
    """

    def __init__(
        self,
        *,
        job_id: str,
        spec: JobSpec,
        policy: Policy | LeaderPolicy,
        rollout: RolloutSession,
        reporter: ProgressReporter,
        run_dir: Path,
        settings: TrainerSettings,
        status: TrainerStatus | None = None,
        checkpoint_dir: Path | None = None,
    ) -> None:
        if spec.rl is None:
            raise ValueError("RlLoop needs an RL job spec")
        self.job_id = job_id
        self.spec = spec
        self.rl: RlConfig = spec.rl
        self.policy = policy
        self.rollout = rollout
        self.reporter = reporter
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = Path(checkpoint_dir or self.run_dir / "checkpoints").resolve()
        self._checkpoint: tuple[int, Path] | None = None  # (step, path) of the last one saved
        self._rng_after_update: tuple[int, dict[str, object]] | None = None  # (step, states)
        self.settings = settings
        self.status = status or TrainerStatus(job_id=job_id, finetune=spec.model.finetune)
        self.status.trainable_parameters = policy.num_trainable_parameters()
        self.policy_version = 0
        self.step = 0
        self.rewards: list[float] = []
        self._truncation = TruncationWatch()  # warns once per job of cut-short episodes
        self._probe_shift = ProbeShiftWatch()  # warns once per job of a probe that can't tell
        self._env_errors = EnvErrorWatch(self.rl)  # env_error_watch.py
        self.log = log.bind(job_id=job_id, env=self.rl.env_name)
        self.validation = Validation(self.rl, timeout_s=settings.collect_timeout_s)
        self.update_config = UpdateConfig.from_rl(self.rl, policy_dtype=policy.dtype)
        self.reports = BackgroundStepReports(reporter.report_step)
        self.batches = BatchPipeline(rollout, self.rl, timeout_s=settings.collect_timeout_s)
        # Built before a resume loads a checkpoint: a full fine-tune's reference is the base.
        self.reference = None
        if self.rl.kl_coef > 0:  # never on several ranks: the spec refuses it there
            assert isinstance(policy, Policy), "kl_coef > 0 with a LeaderPolicy"
            self.reference = ReferencePolicy.from_policy(policy)
        self.critic = (
            Critic(
                policy.model.config.hidden_size,
                learning_rate=self.rl.critic_learning_rate,
                device=policy.device,
            )
            if self.rl.loss == "ppo"
            else None
        )
        for group in policy.optimizer.param_groups:
            group["weight_decay"] = self.rl.weight_decay

    async def run(self) -> Outcome:
        try:
            outcome = await self._train()
        except StorageError as err:  # disk full, read-only, forbidden: as the operator chose
            ending, reason = after_storage_fault(
                str(err), on_storage_error=self.settings.on_storage_error
            )
            return await self._fail(reason, ending)
        except OpenTinkerError as err:
            return await self._fail(str(err))
        except Exception as err:  # a bug or a torch error: still a reported, clean failure
            if group_broke(err):  # another rank, or its node, was lost: not the job's fault
                self.log.warning("rank_group_broke", error=str(err)[:500])
                reason = (
                    f"the job's ranks lost each other at step {self.step + 1} (a rank or its "
                    f"node died, hung or left the network): {type(err).__name__}: {err}"
                )
                return await self._fail(reason, Outcome.RETRY_LATER)
            self.log.exception("trainer_crashed")
            return await self._fail(
                f"trainer error at step {self.step + 1}: {type(err).__name__}: {err}"
            )
        finally:
            await self.rollout.close(
                reason="trainer finished", timeout_s=self.settings.close_timeout_s
            )
        return outcome

    async def _fail(self, reason: str, outcome: Outcome = Outcome.FAILED) -> Outcome:
        """Report ``reason`` and end as ``outcome`` (FAILED, or RETRY_LATER: re-queued)."""
        await self.reports.cancel()
        await self.rollout.close(
            reason=f"trainer failed: {reason}", timeout_s=self.settings.close_timeout_s
        )
        event = "job_failed" if outcome is Outcome.FAILED else "attempt_ended_for_retry"
        await report_failure_logged(self.reporter, reason, self.log, event=event, step=self.step)
        return outcome

    async def _train(self) -> Outcome:
        # Step 0, before the rollout loads its engine: a checkpoint root that cannot take a
        # checkpoint fails now, not at the first save (with checkpoint_every=0: the last step).
        await self._prepare_checkpoints()
        engine = await open_telling_the_user(
            self.rollout, self.reporter, job_id=self.job_id, spec=self.spec, settings=self.settings
        )
        if adopt_roles(self.policy, self.rollout.roles, self.rl):  # before resume loads them
            self.status.trainable_parameters = self.policy.num_trainable_parameters()
        self.log.info(
            "rollout_opened",
            engine=engine,
            trainable_parameters=self.status.trainable_parameters,
            roles=list(self.rollout.roles),
        )
        await self._resume()
        await self._sync_weights()  # the resumed weights, as the resumed policy version
        # A resumed attempt may start at the target already (its final checkpoint was saved,
        # the result not yet taken): it trains no further.
        while self.step < self.rl.steps and not self._reached_target():
            stop = await self._one_step()
            if stop:
                self.log.info("job_cancelled", step=self.step)
                return Outcome.CANCELLED
            if (
                self.rl.checkpoint_every
                and self.step % self.rl.checkpoint_every == 0
                and self.step < self.rl.steps
            ):
                await self._save()
        if self.step < self.rl.steps:
            reward = self._window_mean(-REWARD_WINDOW)
            self.log.info("stop_at_reward_reached", step=self.step, reward=reward)
        if await self.reports.flush():  # the last step's report answered stop
            self.log.info("job_cancelled", step=self.step)
            return Outcome.CANCELLED
        checkpoint = await self._save()
        final = {
            RL_FINAL_REWARD: self._window_mean(-REWARD_WINDOW),
            "reward_mean_first10": self._window_mean(REWARD_WINDOW),
            "steps": float(self.step),
            "policy_version": float(self.policy_version),
        }
        final.update(await self._validate(final=True))
        await self.reporter.report_result(str(checkpoint), final)
        self.log.info("job_succeeded", checkpoint=str(checkpoint), **final)
        return Outcome.SUCCEEDED

    async def _one_step(self) -> bool:
        """Collect, train, sync, report one step; True when the scheduler has said stop (to
        this step's report or an earlier one: reports are answered in the background)."""
        started = time.monotonic()
        batch, played_by = await self.batches.next_batch(self.step, self.policy_version)
        episodes = usable_episodes(
            batch,
            self.rl,
            step=self.step,
            played_by=played_by,
            policy_version=self.policy_version,
        )
        train_started = time.monotonic()
        lr = self._set_learning_rate()
        stats = await asyncio.to_thread(self._update, episodes)
        time_train = time.monotonic() - train_started
        self.policy_version += 1
        self.step += 1
        sync_started = time.monotonic()
        sync, probe_shift = await self._sync_weights(had_gradient=stats.grad_norm > 0)
        time_sync = sync.seconds
        # The rollout applies the weights once it finished the batches requested ahead: the
        # rest of the sync's wall time is waiting for the rollout.
        sync_wait = max(time.monotonic() - sync_started - time_sync, 0.0)
        time_wait = train_started - started + sync_wait
        time_step = time.monotonic() - started

        metrics = step_metrics(
            batch,
            episodes,
            stats,
            StepTimes(
                train_s=time_train,
                sync_s=time_sync,
                step_s=time_step,
                wait_s=time_wait,
            ),
            probe_diff=sync.probe_diff,
            probe=probe_shift,
            lr=lr,
            off_policy_lag=self.policy_version - 1 - played_by,
        )
        metrics.update(await self._validate())
        metrics.update(memory_metrics(self.policy.device))  # validation's peak counted here
        if warning := self._truncation.warning(self.step, [e.truncated_by for e in episodes]):
            self.log.warning("episodes_truncated", step=self.step, message=warning)
            await self.reporter.report_log(warning)
        env_errors = self._env_errors.observe(batch, self.step)
        metrics.update(env_errors.metrics)
        for line in (env_errors.line, env_errors.warning):
            if line:
                self.log.warning("env_trouble", step=self.step, message=line)
                await self.reporter.report_log(line)
        await self._publish(metrics, loss=stats.loss, env_error_reason=env_errors.reason)
        if env_errors.failure:  # the step's figures reach the event stream first
            await self.reports.flush()
            raise EnvironmentError_(env_errors.failure)
        return self.reports.stop_requested

    def _update(self, episodes: list[Episode]) -> TrainStats:
        """One RL update; keeps the generator states as it leaves them, which a checkpoint of
        this step saves (a rollout engine in the same process, as in tests, reseeds torch's
        global generator while it samples the next batch, which may run meanwhile)."""
        if isinstance(self.policy, LeaderPolicy):  # N ranks: rank 0 orders the others along
            stats = self.policy.update(episodes, self.update_config)
        else:
            update = role_update if self.policy.role_adapters else rl_update
            stats = update(
                self.policy,
                episodes,
                self.update_config,
                reference=self.reference,
                critic=self.critic,
            )
        self._rng_after_update = (self.step + 1, checkpoints.rng_state())
        return stats

    async def _publish(
        self, metrics: dict[str, float], *, loss: float, env_error_reason: str = ""
    ) -> None:
        """Keep the step's figures (reward history, status) and report them in the background."""
        reward_mean = metrics["reward_mean"]
        self.rewards.append(reward_mean)
        self.status.step, self.status.policy_version, self.status.last_metrics = (
            self.step,
            self.policy_version,
            metrics,
        )
        self.log.info(
            "step",
            step=self.step,
            policy_version=self.policy_version,
            reward_mean=round(reward_mean, 4),
            loss=round(loss, 5),
            time_step_s=round(metrics["time_step_s"], 3),
        )
        # Sent in the background, with the step's first env error (StepMetrics.env_error_reason).
        await self.reports.put(self.step, self.policy_version, metrics, env_error_reason)

    def _set_learning_rate(self) -> float:
        """The LR of this step's update from the schedule (a function of the step alone, so a
        resumed job continues the schedule); returns it."""
        factor = lr_factor(
            self.step,
            total_steps=self.rl.steps,
            warmup_steps=self.rl.warmup_steps,
            schedule=self.rl.lr_schedule,
        )
        lr = self.rl.learning_rate * factor
        for group in self.policy.optimizer.param_groups:
            group["lr"] = lr
        return lr

    async def _sync_weights(self, *, had_gradient: bool = False) -> tuple[SyncResult, ProbeShift]:
        """Send the trainable weights as ``policy_version`` and verify the rollout serves them;
        the batches this version plays are requested right behind the weights, so the rollout
        goes from applying them to playing without waiting for the trainer.

        Returns the sync's result and what the update did to the probe (nothing, for the
        first).
        had_gradient: whether the update before it had a gradient (else nothing moved, and a
        probe that sees no shift is no news).
        """
        result = await verified_sync(
            self.rollout,
            self.policy,
            version=self.policy_version,
            tolerance=self.settings.probe_tolerance,
            timeout_s=self.settings.weight_sync_timeout_s,
            after_send=self._request_next_batches,
        )
        shift = self._probe_shift.shift(result, self.policy_version)
        if shift is None:
            return result, ProbeShift(0.0, 0)
        warning = self._probe_shift.warning(
            shift, result.tolerance, self.step, had_gradient=had_gradient
        )
        if warning:
            self.log.warning("probe_cannot_tell_versions", step=self.step, message=warning)
            await self.reporter.report_log(warning)
        return result, shift

    async def _request_next_batches(self) -> None:
        if self.step < self.rl.steps:
            await self.batches.request_ahead(self.step, self.policy_version)

    async def _validate(self, *, final: bool = False) -> dict[str, float]:
        """val/* metrics of the policy after this step when a validation is due (every
        val_every steps, after the last step, and at the end when ``final``); else none."""
        if not (self.validation.due(self.step) or (final and self.validation.enabled)):
            return {}
        return await self.validation.run(self.rollout, self.step)

    def _rng_of_this_step(self) -> dict[str, object] | None:
        """The generator states the update of the current step left (None: none ran here)."""
        if self._rng_after_update is not None and self._rng_after_update[0] == self.step:
            return self._rng_after_update[1]
        return None

    async def _save(self) -> Path:
        """Checkpoint the current step (once: a step already saved returns its path)."""
        if self._checkpoint is not None and self._checkpoint[0] == self.step:
            return self._checkpoint[1]
        state = checkpoints.TrainerState(
            job_id=self.job_id,
            step=self.step,
            policy_version=self.policy_version,
            rewards=self.rewards,
            data_cursor=self.step,  # _one_step collects batch_index = self.step
        )
        path = await asyncio.to_thread(
            checkpoints.save,
            self.policy,
            state,
            self.checkpoint_dir,
            keep=self.settings.keep_checkpoints,
            critic=self.critic,
            rng=self._rng_of_this_step(),
        )
        self._checkpoint = (self.step, path)
        self.log.info("checkpoint_saved", path=str(path), step=self.step)
        return path

    async def _prepare_checkpoints(self) -> None:
        """The checkpoint folder can be written and has room for one checkpoint; what killed
        attempts left half-made there is deleted (checkpoints.prepare)."""
        need = checkpoints.size_lower_bound(self.policy)
        removed = await asyncio.to_thread(checkpoints.prepare, self.checkpoint_dir, need_bytes=need)
        for partial in removed:
            self.log.warning("partial_checkpoint_removed", path=str(partial))

    async def _resume(self) -> None:
        """Load the last complete checkpoint an earlier attempt left, if any: weights,
        optimizer, RNG, step, policy version and step rewards."""
        path = checkpoints.latest(self.checkpoint_dir)
        if path is None:
            return
        state = await asyncio.to_thread(
            functools.partial(checkpoints.load, critic=self.critic), self.policy, path
        )
        if state.job_id != self.job_id:
            raise CheckpointError(
                f"checkpoint {path} belongs to job {state.job_id!r}, not {self.job_id!r}; "
                "give each job its own checkpoint folder"
            )
        self.step, self.policy_version = state.step, state.policy_version
        self.rewards = list(state.rewards)
        self._checkpoint = (self.step, path)
        self.status.step, self.status.policy_version = self.step, self.policy_version
        self.log.info("checkpoint_resumed", path=str(path), step=self.step)
        await self.reporter.report_log(
            f"resumed from checkpoint {path.name} (step {self.step}, policy version "
            f"{self.policy_version})"
        )

    def _reached_target(self) -> bool:
        target = self.rl.stop_at_reward
        return (
            target is not None
            and len(self.rewards) >= REWARD_WINDOW
            and self._window_mean(-REWARD_WINDOW) >= target
        )

    def _window_mean(self, n: int) -> float:
        """Mean step reward of the first n steps (n > 0) or the last -n steps (n < 0)."""
        window = self.rewards[:n] if n > 0 else self.rewards[n:]
        return sum(window) / len(window) if window else 0.0
