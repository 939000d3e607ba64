"""One training session: the policy, its accumulated gradients, its sampler, its life.

Knows nothing of gRPC (servicer.py translates). Model work runs in a worker thread so the
server stays responsive; calls run one at a time in the client's order (``call``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import structlog
import torch

from opentinker.common.v1 import common_pb2
from opentinker.errors import FailedPreconditionError, InvalidArgumentError, OpenTinkerError
from opentinker.services.rollout.agent.seeds import derive_seed
from opentinker.services.trainer.model.policy import Policy, Probe
from opentinker.services.trainer.rl.step_reports import BackgroundStepReports, StepReport
from opentinker.services.trainer.rollout_link.weight_sync import SyncResult
from opentinker.services.trainer.session import state
from opentinker.services.trainer.session.data import Datum, collate_data
from opentinker.services.trainer.session.objective import LossResult, LossSpec, evaluate
from opentinker.services.trainer.session.ordering import CallOrder
from opentinker.services.trainer.session.sampler import Sample, SessionSampler
from opentinker.services.trainer.session.snapshots import Snapshots
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.session_config import SessionConfig

log = structlog.get_logger(__name__)
_T = TypeVar("_T")


class RunWork(Protocol):
    """Runs a unit of model work off the event loop and returns its result."""

    def __call__(self, fn: Callable[[], _T], /) -> Awaitable[_T]: ...


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyperparameters of one optimizer step (``grad_clip_norm`` 0 = no clipping)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def check(self) -> None:
        """INVALID_ARGUMENT naming each bad field; a NaN or inf would reach every weight."""
        problems = []
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            problems.append(f"adam.learning_rate must be finite and > 0, got {self.learning_rate}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                problems.append(f"adam.{name} must be in [0, 1), got {getattr(self, name)}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            problems.append(f"adam.eps must be finite and > 0, got {self.eps}")
        for name in ("weight_decay", "grad_clip_norm"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"adam.{name} must be finite and >= 0, got {value}")
        if problems:
            raise InvalidArgumentError("; ".join(problems), reason="BAD_ADAM_PARAMS")


class TrainingSession:
    """A session job's trainer state; ``ended`` is set when it is closed or idle too long."""

    def __init__(
        self,
        *,
        job_id: str,
        tenant_id: str,
        policy: Policy,
        sampler: SessionSampler,
        config: SessionConfig,
        checkpoint_root: Path,
        settings: TrainerSettings,
        report_step: StepReport | None = None,
        run_work: RunWork | None = None,
    ) -> None:
        """``report_step``: where each optimizer step's metrics go (the scheduler's event
        stream and usage: steps, tokens trained and generated since the last step). They go
        in the background (step_reports.py): a slow or restarting scheduler never holds up
        optim_step's answer, and a report that finally fails, or a stop answer, ends the
        session at the next optim_step, before it moves the weights. ``run_work``: where
        forward, forward_backward and optim_step run (a worker thread of its own; on a shared
        LoRA host, the session's fair turn: host.py)."""
        self._run_work: RunWork = run_work or asyncio.to_thread
        self.job_id, self.tenant_id = job_id, tenant_id
        self._reports = BackgroundStepReports(report_step) if report_step is not None else None
        # Per step, for the job's metrics and the tenant's accounting: model_s, the seconds of
        # model work its calls took; turn_wait_s, the seconds they waited for their turn (on a
        # shared host, other sessions' work; 0 on a device of its own but for thread start).
        self._since_step = {
            "loss": 0.0,
            "tokens_trained": 0.0,
            "tokens_generated": 0.0,
            "model_s": 0.0,
            "turn_wait_s": 0.0,
        }
        self.policy, self.sampler, self.config = policy, sampler, config
        self.checkpoint_root = Path(checkpoint_root)
        self.settings = settings
        self.step = 0
        self.accumulated_calls = 0
        self.end_reason = ""
        self.ended = asyncio.Event()
        self._order = CallOrder(wait_s=config.order_wait_s)
        self.snapshots = Snapshots(
            memory_bytes=int(settings.sampler_snapshot_memory_mb * 2**20),
            spill_dir=self.checkpoint_root / job_id / "sampler_snapshots",
        )
        self._busy = 0
        self._last_activity = time.monotonic()
        self.log = log.bind(job_id=job_id)

    @property
    def last_seq(self) -> int:
        return self._order.last_seq

    @asynccontextmanager
    async def call(self, seq: int) -> AsyncIterator[None]:
        """Run the body as call ``seq`` of this session, in order, while it is open."""
        self._touch()
        self._busy += 1
        try:
            async with self._order.turn(seq):
                if self.end_reason:
                    raise FailedPreconditionError(
                        f"session {self.job_id} has ended ({self.end_reason}); start a new one",
                        reason="SESSION_ENDED",
                    )
                yield
        finally:
            self._busy -= 1
            self._touch()

    def _touch(self) -> None:
        self._last_activity = time.monotonic()

    def idle_seconds(self) -> float:
        return 0.0 if self._busy else time.monotonic() - self._last_activity

    def end(self, reason: str) -> None:
        if not self.end_reason:
            self.end_reason = reason
            self.log.info("session_ended", reason=reason, steps=self.step)
            self.ended.set()

    async def watch_idle(self) -> None:
        """End the session after ``idle_timeout_s`` without a call (run as a task)."""
        limit = self.config.idle_timeout_s
        while not self.ended.is_set():
            await asyncio.sleep(min(1.0, limit / 4))
            if self.idle_seconds() >= limit:
                self.end("idle timeout")

    # ---- the primitives (call each inside ``call(seq)``) ----

    async def forward(self, data: Sequence[Datum], loss: LossSpec) -> LossResult:
        return await self._work(lambda: self._forward(data, loss, False))

    async def forward_backward(self, data: Sequence[Datum], loss: LossSpec) -> LossResult:
        result = await self._work(lambda: self._forward(data, loss, True))
        self.accumulated_calls += 1
        self._since_step["loss"] += float(result.loss.detach())
        self._since_step["tokens_trained"] += result.metrics["tokens"]
        return result

    async def _work(self, fn: Callable[[], _T]) -> _T:
        """``fn`` through ``run_work``, its model seconds and its wait for a turn counted."""
        busy = [0.0]

        def timed() -> _T:
            started = time.perf_counter()
            try:
                return fn()
            finally:
                busy[0] = time.perf_counter() - started

        queued = time.perf_counter()
        try:
            return await self._run_work(timed)
        finally:
            self._since_step["model_s"] += busy[0]
            self._since_step["turn_wait_s"] += max(0.0, time.perf_counter() - queued - busy[0])

    def _forward(self, data: Sequence[Datum], loss: LossSpec, backward: bool) -> LossResult:
        batch = collate_data(
            data,
            loss.name,
            pad_id=self.policy.pad_id,
            # nn.Embedding's int; nn.Module.__getattr__ types any attribute as Tensor | Module.
            vocab_size=self.policy.model.get_input_embeddings().num_embeddings,  # type: ignore[arg-type]
            max_tokens=self.config.max_batch_tokens,
        )
        if not backward:
            with torch.no_grad():
                return evaluate(self.policy, batch, loss)
        result = evaluate(self.policy, batch, loss)
        result.loss.backward()  # adds to the gradients of earlier calls until optim_step
        return result

    async def optim_step(self, adam: AdamParams) -> tuple[int, float]:
        """Apply the accumulated gradients with AdamW; returns (steps so far, grad norm)."""
        adam.check()
        if self.accumulated_calls == 0:
            raise FailedPreconditionError(
                "optim_step without gradients: call forward_backward first", reason="NO_GRADIENTS"
            )
        self._check_reports()
        grad_norm = await self._work(lambda: self._step(adam))
        self.step += 1
        self.accumulated_calls = 0
        metrics = {**self._since_step, "grad_norm": grad_norm, "learning_rate": adam.learning_rate}
        self._since_step = dict.fromkeys(self._since_step, 0.0)
        if self._reports is not None:
            await self._reports.put(self.step, self.sampler.policy_version, metrics)
        return self.step, grad_norm

    def _check_reports(self) -> None:
        """Raise (and end the session) when a step report finally failed or was answered
        with stop (the job was cancelled or superseded)."""
        if self._reports is None:
            return
        try:
            stop = self._reports.stop_requested
        except Exception as err:
            message = err.message if isinstance(err, OpenTinkerError) else str(err)
            self.end(f"step report failed: {message}")
            raise
        if stop:
            self.end("stopped by the scheduler")
            raise FailedPreconditionError(
                f"session {self.job_id} was stopped by the scheduler", reason="SESSION_ENDED"
            )

    async def flush_reports(self) -> None:
        """Wait until every step report was answered (the session's end); a failed one or a
        stop answer ends the session."""
        if self._reports is None:
            return
        with contextlib.suppress(Exception):  # raised again by stop_requested: ends it there
            await self._reports.flush()
        with contextlib.suppress(Exception):
            self._check_reports()

    def take_unreported_tokens(self) -> tuple[float, float]:
        """Tokens (generated, trained) since the last report that carried them (a step's, the
        periodic usage report's), for the next one: taken, they count from 0 again."""
        since = self._since_step
        taken = since["tokens_generated"], since["tokens_trained"]
        since["tokens_generated"] = since["tokens_trained"] = 0.0
        return taken

    def untake_tokens(self, generated: float, trained: float) -> None:
        """A report of taken tokens that did not reach the scheduler: the next one carries them."""
        self._since_step["tokens_generated"] += generated
        self._since_step["tokens_trained"] += trained

    def _step(self, adam: AdamParams) -> float:
        for group in self.policy.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        return self.policy.optimizer_step(adam.grad_clip_norm or math.inf)

    async def save_weights_for_sampler(self) -> tuple[int, float]:
        """Serve the current weights on the sampler and keep them as that version's snapshot
        (its samplers sample them until they end); (policy version, probe max |Δlogprob|)."""
        result = await self.sampler.publish(
            self.policy, timeout_s=self.settings.weight_sync_timeout_s
        )
        await asyncio.to_thread(self.keep_snapshot, result)
        return self.sampler.policy_version, result.probe_diff

    def keep_snapshot(self, result: SyncResult) -> None:
        """Keep the weights just published (the newest version) as its snapshot."""
        probe = Probe(list(result.probe_logprobs), 0.0)  # the tolerance is kept as computed
        version = self.sampler.policy_version
        self.snapshots.keep(self.policy, version, probe, result.tolerance)

    async def sample(
        self,
        prompt: Sequence[int],
        *,
        num_samples: int,
        sampling: common_pb2.SamplingParams,
        stop_token_ids: Sequence[int],
        seed: int,
        seq: int,
        policy_version: int = 0,
        greedy: bool = False,
    ) -> tuple[list[Sample], int]:
        """Completions of ``prompt`` by the weights served as ``policy_version`` (0: the
        newest served); the version that made them."""
        await self.serve_version(policy_version)
        samples, version = await self.sampler.sample(
            prompt,
            num_samples=num_samples or 1,
            sampling=sampling,
            stop_token_ids=stop_token_ids,
            seed=seed or derive_seed(self.config.seed, "session-sample", seq),
            timeout_s=self.settings.collect_timeout_s,
            greedy=greedy,
        )
        self._since_step["tokens_generated"] += sum(len(s.tokens) for s in samples)
        return samples, version

    async def serve_version(self, policy_version: int) -> None:
        """Have the sampler serve ``policy_version`` (0: the newest served): a snapshot other
        than the one served now is swapped in by a verified sync."""
        target = policy_version or self.sampler.policy_version
        if target > self.sampler.policy_version:
            raise InvalidArgumentError(
                f"policy_version: {target} was not served yet (newest: "
                f"{self.sampler.policy_version})",
                reason="NO_SNAPSHOT",
            )
        if target == self.sampler.served_version:
            return
        snapshot = await asyncio.to_thread(self.snapshots.get, target)
        await self.sampler.serve(
            snapshot,
            target,
            tolerance=snapshot.tolerance,
            timeout_s=self.settings.weight_sync_timeout_s,
        )

    async def prompt_logprobs(self, prompt: Sequence[int]) -> list[float]:
        """The prompt scored by the sampler's weights (empty for a 1-token prompt)."""
        if len(prompt) < 2:
            return []
        return await self.sampler.score(prompt, timeout_s=self.settings.collect_timeout_s)

    async def save_state(self, name: str) -> Path:
        owner = state.SavedSession(
            tenant_id=self.tenant_id, job_id=self.job_id, model=self.policy.spec, step=self.step
        )
        return await asyncio.to_thread(
            state.save_state, self.policy, root=self.checkpoint_root, name=name, owner=owner
        )

    async def load_state(self, path: str) -> int:
        saved = await asyncio.to_thread(
            state.load_state,
            self.policy,
            path,
            root=self.checkpoint_root,
            tenant_id=self.tenant_id,
        )
        self.step, self.accumulated_calls = saved.step, 0
        return self.step
