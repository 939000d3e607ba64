"""The managed SFT loop: data -> batches -> (train step, report)* with validation and
checkpoints -> result.

No rollout: the trainer alone runs an SFT job. Like the RL loop it knows nothing of gRPC (it
reports through a ``ProgressReporter``) and runs model work in a worker thread. The batches
are a pure function of (data, seed, step): epoch e shuffles the training rows with seed
``seed + e``, so a resumed attempt continues with exactly the batch the last one would have
trained next.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from opentinker.errors import OpenTinkerError
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.errors import CheckpointError
from opentinker.services.trainer.job_types import (
    Outcome,
    ProgressReporter,
    TrainerStatus,
    after_storage_fault,
)
from opentinker.services.trainer.model.memory_metrics import memory_metrics
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.reporter import report_failure_logged
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.services.trainer.sft.batches import SftBatch, make_batches
from opentinker.services.trainer.sft.data import (
    Example,
    read_conversations,
    render_all,
    split_validation,
)
from opentinker.services.trainer.sft.step import train_step, validation_loss
from opentinker.services.trainer.storage import StorageError
from opentinker.spec import JobSpec, SftConfig

log = structlog.get_logger()

INITIAL_VAL_LOSS = "val/loss_initial"


@dataclass(frozen=True)
class SftData:
    train: list[Example]
    validation: list[Example]


def load_data(sft: SftConfig, policy: Policy) -> SftData:
    """Read, split and render the job's rows with the policy's tokenizer (DatasetError)."""
    rows = read_conversations(sft.dataset_path)
    if sft.validation_path is not None:
        train_rows, val_rows = rows, read_conversations(sft.validation_path)
    else:
        train_rows, val_rows = split_validation(rows, fraction=sft.held_out_fraction, seed=sft.seed)
    length = sft.max_sequence_length
    return SftData(
        train=render_all(policy.tokenizer, train_rows, max_length=length),
        validation=render_all(policy.tokenizer, val_rows, max_length=length),
    )


class SftSchedule:
    """The training batches, step by step: epoch after epoch, each reshuffled (so a packed
    epoch's batch count may differ a little from the last), until ``sft.steps`` (when set)
    or ``sft.epochs`` passes."""

    def __init__(self, examples: list[Example], sft: SftConfig, pad_id: int) -> None:
        self._examples, self._sft, self._pad_id = examples, sft, pad_id
        self._current: tuple[int, list[SftBatch]] | None = None  # one epoch kept in memory
        self._lengths: dict[int, int] = {}
        self.batches_per_epoch = self.length(0)
        self.total_steps = sft.steps or sum(self.length(e) for e in range(sft.epochs))

    def epoch(self, index: int) -> list[SftBatch]:
        if self._current is None or self._current[0] != index:
            batches = make_batches(
                self._examples,
                max_tokens=self._sft.max_tokens_per_batch,
                max_length=self._sft.max_sequence_length,
                packing=self._sft.packing,
                pad_id=self._pad_id,
                shuffle_seed=self._sft.seed + index,
            )
            self._current = (index, batches)
            self._lengths[index] = len(batches)
        return self._current[1]

    def length(self, epoch: int) -> int:
        if epoch not in self._lengths:
            self.epoch(epoch)
        return self._lengths[epoch]

    def batch(self, step: int) -> tuple[int, SftBatch]:
        """(epoch, batch) trained at 0-based ``step``."""
        epoch, index = 0, step
        while index >= self.length(epoch):
            index -= self.length(epoch)
            epoch += 1
        return epoch, self.epoch(epoch)[index]


class SftLoop:
    """Runs one SFT job to its end; ``run`` reports a failure itself and returns the Outcome.
    Checkpoints and resume work as in the RL loop (checkpoints.py)."""

    def __init__(
        self,
        *,
        job_id: str,
        spec: JobSpec,
        policy: Policy,
        reporter: ProgressReporter,
        settings: TrainerSettings,
        checkpoint_dir: Path,
        status: TrainerStatus | None = None,
    ) -> None:
        if spec.sft is None:
            raise ValueError("SftLoop needs an SFT job spec")
        self.job_id, self.sft, self.policy = job_id, spec.sft, policy
        self.reporter, self.settings = reporter, settings
        self.checkpoint_dir = Path(checkpoint_dir).resolve()
        self.status = status or TrainerStatus(job_id=job_id, finetune=spec.model.finetune)
        self.status.trainable_parameters = policy.num_trainable_parameters()
        self.step = 0
        self.initial_val_loss: float | None = None
        self._saved_step: int | None = None
        self.log = log.bind(job_id=job_id, kind="sft")

    async def run(self) -> Outcome:
        try:
            return await self._train()
        except StorageError as err:  # disk full, read-only, forbidden: as the operator chose
            ending, reason = after_storage_fault(
                str(err), on_storage_error=self.settings.on_storage_error
            )
            return await self._fail(reason, ending)
        except OpenTinkerError as err:
            return await self._fail(str(err))
        except Exception as err:  # a bug or a torch error: still a reported, clean failure
            self.log.exception("trainer_crashed")
            return await self._fail(
                f"trainer error at step {self.step + 1}: {type(err).__name__}: {err}"
            )

    async def _fail(self, reason: str, outcome: Outcome = Outcome.FAILED) -> Outcome:
        event = "job_failed" if outcome is Outcome.FAILED else "attempt_ended_for_retry"
        await report_failure_logged(self.reporter, reason, self.log, event=event, step=self.step)
        return outcome

    async def _train(self) -> Outcome:
        # Step 0: a checkpoint root that cannot take a checkpoint fails now, not at the end.
        need = checkpoints.size_lower_bound(self.policy)
        removed = await asyncio.to_thread(checkpoints.prepare, self.checkpoint_dir, need_bytes=need)
        for partial in removed:
            self.log.warning("partial_checkpoint_removed", path=str(partial))
        data = await asyncio.to_thread(load_data, self.sft, self.policy)
        schedule = await asyncio.to_thread(SftSchedule, data.train, self.sft, self.policy.pad_id)
        val_batches = make_batches(
            data.validation,
            max_tokens=self.sft.max_tokens_per_batch,
            max_length=self.sft.max_sequence_length,
            packing=self.sft.packing,
            pad_id=self.policy.pad_id,
        )
        self.log.info(
            "sft_data_loaded",
            train_rows=len(data.train),
            validation_rows=len(data.validation),
            batches_per_epoch=schedule.batches_per_epoch,
            steps=schedule.total_steps,
        )
        await self._resume()
        if self.initial_val_loss is None:
            self.initial_val_loss = await asyncio.to_thread(
                validation_loss, self.policy, val_batches
            )
            self.log.info("validation", step=0, val_loss=round(self.initial_val_loss, 5))
        metrics: dict[str, float] = {}
        while self.step < schedule.total_steps:
            metrics = await self._one_step(schedule, val_batches)
            if await self.reporter.report_step(self.step, self.step, metrics):
                self.log.info("job_cancelled", step=self.step)
                return Outcome.CANCELLED
            every = self.sft.checkpoint_every
            if every and self.step % every == 0 and self.step < schedule.total_steps:
                await self._save()
        if "val/loss" not in metrics:  # the last step was no eval step (or none ran)
            metrics["val/loss"] = await asyncio.to_thread(validation_loss, self.policy, val_batches)
        checkpoint = await self._save()
        final = {
            "val/loss": metrics["val/loss"],
            INITIAL_VAL_LOSS: self.initial_val_loss,
            "steps": float(self.step),
            "epochs": self.step / schedule.batches_per_epoch,
        }
        if "train/loss" in metrics:
            final["train/loss"] = metrics["train/loss"]
        await self.reporter.report_result(str(checkpoint), final)
        self.log.info("job_succeeded", checkpoint=str(checkpoint), **final)
        return Outcome.SUCCEEDED

    async def _one_step(self, schedule: SftSchedule, val_batches: list[SftBatch]) -> dict:
        started = time.monotonic()
        epoch, batch = schedule.batch(self.step)
        stats = await asyncio.to_thread(
            train_step, self.policy, batch, max_grad_norm=self.sft.max_grad_norm
        )
        seconds = time.monotonic() - started
        self.step += 1
        metrics = {
            "train/loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "tokens_per_s": stats.tokens / seconds if seconds > 0 else 0.0,
            "tokens_trained": float(stats.trained_tokens),  # accounted per tenant (quotas.py)
            "batch_tokens": float(stats.tokens),
            "batch_examples": float(batch.num_examples),
            "epoch": float(epoch),
            "time_train_s": seconds,
            **memory_metrics(self.policy.device),
        }
        every = self.sft.eval_every
        if every and self.step % every == 0 or self.step == schedule.total_steps:
            metrics["val/loss"] = await asyncio.to_thread(validation_loss, self.policy, val_batches)
        self.status.step = self.status.policy_version = self.step
        self.status.last_metrics = metrics
        self.log.info(
            "step",
            step=self.step,
            train_loss=round(stats.loss, 5),
            val_loss=round(metrics.get("val/loss", float("nan")), 5),
            tokens_per_s=round(metrics["tokens_per_s"], 1),
        )
        return metrics

    async def _save(self) -> Path:
        path = self.checkpoint_dir / checkpoints.step_name(self.step)
        if self._saved_step == self.step:
            return path
        state = checkpoints.TrainerState(
            job_id=self.job_id,
            kind="sft",
            step=self.step,
            policy_version=self.step,
            data_cursor=self.step,
            extra={INITIAL_VAL_LOSS: self.initial_val_loss or 0.0},
        )
        path = await asyncio.to_thread(
            checkpoints.save,
            self.policy,
            state,
            self.checkpoint_dir,
            keep=self.settings.keep_checkpoints,
        )
        self._saved_step = self.step
        self.log.info("checkpoint_saved", path=str(path), step=self.step)
        return path

    async def _resume(self) -> None:
        path = checkpoints.latest(self.checkpoint_dir)
        if path is None:
            return
        state = await asyncio.to_thread(checkpoints.load, self.policy, path)
        if state.job_id != self.job_id or state.kind != "sft":
            raise CheckpointError(
                f"checkpoint {path} belongs to {state.kind} job {state.job_id!r}, not SFT job "
                f"{self.job_id!r}; give each job its own checkpoint folder"
            )
        self.step, self._saved_step = state.step, state.step
        self.initial_val_loss = state.extra.get(INITIAL_VAL_LOSS)
        self.status.step = self.status.policy_version = self.step
        self.log.info("checkpoint_resumed", path=str(path), step=self.step)
        await self.reporter.report_log(f"resumed from checkpoint {path.name} (step {self.step})")
