"""A training session: your own loop drives the trainer, Tinker-style.

    with client.training_session(base_model="Qwen/Qwen2.5-0.5B", lora_rank=8) as session:
        out = session.forward_backward([Datum.from_sequence(ids, weights=w)], "cross_entropy")
        session.optim_step(AdamParams(learning_rate=1e-4))
        session.save_weights_for_sampler()
        samples = session.sample(prompt_ids, num_samples=4)

Each call has a blocking form and a future form (``forward_backward_async`` returns a
``concurrent.futures.Future``; ``.result()`` waits, ``await asyncio.wrap_future(f)`` in async
code). Calls run in the order they were made: each gets the next sequence number, and one
worker thread sends them in that order. No torch needed: tokens and per-token values are lists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from opentinker.common.v1 import common_pb2
from opentinker.connection import Connection
from opentinker.errors import JobFailedError, UnavailableError
from opentinker.jobs import JobInfo
from opentinker.spec import SamplingParams
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

T = TypeVar("T")
LossName = Literal[
    "cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "stable_reinforce", "dro"
]
_LOSS_PB = {
    "cross_entropy": trainer_pb2.SESSION_LOSS_CROSS_ENTROPY,
    "importance_sampling": trainer_pb2.SESSION_LOSS_IMPORTANCE_SAMPLING,
    "ppo": trainer_pb2.SESSION_LOSS_PPO,
    "cispo": trainer_pb2.SESSION_LOSS_CISPO,
    "gspo": trainer_pb2.SESSION_LOSS_GSPO,
    "stable_reinforce": trainer_pb2.SESSION_LOSS_STABLE_REINFORCE,
    "dro": trainer_pb2.SESSION_LOSS_DRO,
}


@dataclass(frozen=True)
class Datum:
    """One example. Position t of every list concerns ``target_tokens[t]``, predicted from
    ``input_tokens[:t+1]``; targets are the inputs shifted by one. Build it from one token
    sequence with ``from_sequence``."""

    input_tokens: list[int]
    target_tokens: list[int]
    weights: list[float] | None = None  # cross_entropy (None = all 1); stable_reinforce (needed)
    sampling_logprobs: list[float] | None = None  # importance_sampling / ppo
    advantages: list[float] | None = None  # importance_sampling / ppo
    sequence_ratio_mask: list[float] | None = None  # gspo: positions of the sequence ratio

    @classmethod
    def from_sequence(
        cls,
        tokens: Sequence[int],
        *,
        weights: Sequence[float] | None = None,
        sampling_logprobs: Sequence[float] | None = None,
        advantages: Sequence[float] | None = None,
    ) -> Datum:
        """From one sequence and values per token of it (len(tokens) each; the value of token
        i is used when predicting token i, so the first token's value is dropped)."""

        def shift(values: Sequence[float] | None) -> list[float] | None:
            if values is None:
                return None
            if len(values) != len(tokens):
                raise ValueError(f"{len(values)} values for {len(tokens)} tokens")
            return [float(v) for v in values[1:]]

        if len(tokens) < 2:
            raise ValueError("a datum needs a sequence of at least 2 tokens")
        return cls(
            input_tokens=list(tokens[:-1]),
            target_tokens=list(tokens[1:]),
            weights=shift(weights),
            sampling_logprobs=shift(sampling_logprobs),
            advantages=shift(advantages),
        )

    def to_proto(self) -> trainer_pb2.Datum:
        return trainer_pb2.Datum(
            input_tokens=self.input_tokens,
            target_tokens=self.target_tokens,
            weights=self.weights or [],
            sampling_logprobs=self.sampling_logprobs or [],
            advantages=self.advantages or [],
            sequence_ratio_mask=self.sequence_ratio_mask or [],
        )


@dataclass(frozen=True)
class AdamParams:
    """AdamW settings of one optim_step."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping


@dataclass(frozen=True)
class ForwardOutput:
    """loss: summed over tokens and data; logprobs: per datum, of each target token."""

    loss: float
    logprobs: list[list[float]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimStepOutput:
    step: int
    grad_norm: float


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]  # the completion, the stop token included
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    # topk_sample_logprobs = k: per token, the k likeliest (token, logprob) at its position
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class SampleOutput:
    sequences: list[SampledSequence]
    policy_version: int
    # include_prompt_logprobs: logprob of prompt[i+1] given prompt[:i+1] (len(prompt) - 1)
    prompt_logprobs: list[float] = field(default_factory=list)
    # topk_prompt_logprobs = k: as SampledSequence.top_logprobs, for prompt[1:]
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class TrainingSession:
    """A running session job's trainer. Thread-safe; close it (or use ``with``) when done."""

    def __init__(
        self, job: JobInfo, *, api_key: str | None, timeout: float, on_close: Callable[[], None]
    ) -> None:
        self.job_id = job.job_id
        self.endpoint = job.endpoint
        self._conn = Connection(job.endpoint, api_key=api_key, timeout=timeout)
        self._stub = trainer_pb2_grpc.TrainerServiceStub(self._conn.channel)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session")
        self._seq = 0
        self._lock = threading.Lock()
        self._on_close = on_close
        self._closed = False

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, method: Any, make: Callable[[trainer_pb2.SessionCall], Any], out) -> Future:
        """Queue one call with the next seq; ``out`` turns the reply into the result. A request
        the SDK refuses to build (bad loss, bad data) raises here and takes no seq: a seq never
        sent would hold up every later call of the session on the trainer."""
        with self._lock:
            request = make(trainer_pb2.SessionCall(session_id=self.job_id, seq=self._seq + 1))
            self._seq += 1
            return self._worker.submit(lambda: out(self._conn.call(method, request, None)))

    # ---- forward / forward_backward ----

    def forward_async(
        self, data: Sequence[Datum], loss_fn: LossName = "cross_entropy", **loss_config: float
    ) -> Future[ForwardOutput]:
        """Loss and logprobs without gradients. ``loss_config``: ppo's clip_low_threshold /
        clip_high_threshold (ratio bounds, default 0.8 / 1.2; also cispo and gspo), and
        stable_reinforce's kl_coeff (default 0)."""
        return self._submit(
            self._stub.Forward,
            lambda c: trainer_pb2.ForwardRequest(
                call=c, data=[d.to_proto() for d in data], loss=_loss(loss_fn, loss_config)
            ),
            _forward_output,
        )

    def forward(self, data: Sequence[Datum], loss_fn: LossName = "cross_entropy", **kw: float):
        return self.forward_async(data, loss_fn, **kw).result()

    def forward_backward_async(
        self, data: Sequence[Datum], loss_fn: LossName = "cross_entropy", **loss_config: float
    ) -> Future[ForwardOutput]:
        """Loss, logprobs, and gradients added to those of earlier calls until optim_step."""
        return self._submit(
            self._stub.ForwardBackward,
            lambda c: trainer_pb2.ForwardBackwardRequest(
                call=c, data=[d.to_proto() for d in data], loss=_loss(loss_fn, loss_config)
            ),
            _forward_output,
        )

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: LossName = "cross_entropy", **kw: float
    ) -> ForwardOutput:
        return self.forward_backward_async(data, loss_fn, **kw).result()

    # ---- optimizer, sampler, state ----

    def optim_step_async(self, adam: AdamParams) -> Future[OptimStepOutput]:
        pb = trainer_pb2.AdamParams(**adam.__dict__)
        return self._submit(
            self._stub.OptimStep,
            lambda c: trainer_pb2.OptimStepRequest(call=c, adam=pb),
            lambda r: OptimStepOutput(step=r.step, grad_norm=r.grad_norm),
        )

    def optim_step(self, adam: AdamParams) -> OptimStepOutput:
        return self.optim_step_async(adam).result()

    def sample_async(
        self,
        prompt_tokens: Sequence[int],
        *,
        num_samples: int = 1,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
        include_prompt_logprobs: bool = False,
        policy_version: int = 0,
        greedy: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> Future[SampleOutput]:
        """``num_samples`` completions with the weights of the last save_weights_for_sampler
        (a completion ends after a stop token or eos, which it keeps); with
        ``include_prompt_logprobs`` also the prompt's logprobs under those weights.
        ``policy_version``: the weights served by an earlier save_weights_for_sampler (the
        version it returned) instead: a sampler snapshot, kept for the session's life.
        ``greedy``: argmax decoding (``sampling``'s temperature and top_p unused; logprobs
        at temperature 1). ``topk_prompt_logprobs`` / ``topk_sample_logprobs``: also the k
        likeliest tokens at each prompt position / sampled token (0..64)."""
        s = sampling or SamplingParams()
        pb = common_pb2.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens
        )
        return self._submit(
            self._stub.Sample,
            lambda c: trainer_pb2.SampleRequest(
                call=c,
                prompt_tokens=list(prompt_tokens),
                num_samples=num_samples,
                sampling=pb,
                stop_token_ids=list(stop_token_ids),
                seed=seed,
                include_prompt_logprobs=include_prompt_logprobs,
                policy_version=policy_version,
                greedy=greedy,
                topk_prompt_logprobs=topk_prompt_logprobs,
                topk_sample_logprobs=topk_sample_logprobs,
            ),
            _sample_output,
        )

    def sample(self, prompt_tokens: Sequence[int], **kw: Any) -> SampleOutput:
        return self.sample_async(prompt_tokens, **kw).result()

    def save_weights_for_sampler_async(self) -> Future[int]:
        """Serve the current weights to sample (verified); the new policy version."""
        return self._submit(
            self._stub.SaveWeightsForSampler,
            lambda c: trainer_pb2.SaveWeightsForSamplerRequest(call=c),
            lambda r: r.policy_version,
        )

    def save_weights_for_sampler(self) -> int:
        return self.save_weights_for_sampler_async().result()

    def save_state_async(self, name: str) -> Future[str]:
        """Save weights + optimizer state as ``name``; the path load_state takes."""
        return self._submit(
            self._stub.SaveState,
            lambda c: trainer_pb2.SaveStateRequest(call=c, name=name),
            lambda r: r.path,
        )

    def save_state(self, name: str) -> str:
        return self.save_state_async(name).result()

    def load_state_async(self, path: str) -> Future[int]:
        """Restore a saved state (this tenant's, same model); the step it continues from."""
        return self._submit(
            self._stub.LoadState,
            lambda c: trainer_pb2.LoadStateRequest(call=c, path=path),
            lambda r: r.step,
        )

    def load_state(self, path: str) -> int:
        return self.load_state_async(path).result()

    def get_info(self, *, timeout: float | None = None) -> trainer_pb2.GetSessionInfoResponse:
        request = trainer_pb2.GetSessionInfoRequest(session_id=self.job_id)
        return self._conn.call(self._stub.GetSessionInfo, request, timeout)

    def close(self) -> None:
        """End the session: its job SUCCEEDS and frees its device (waits for that, up to the
        client's timeout). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._submit(
                self._stub.CloseSession,
                lambda c: trainer_pb2.CloseSessionRequest(call=c),
                lambda r: None,
            ).result()
        finally:
            self._worker.shutdown(wait=True)
            self._conn.close()
        self._on_close()


def wait_until_serving(
    get_job: Callable[[str], JobInfo], job_id: str, *, timeout: float, poll_s: float = 0.2
) -> JobInfo:
    """Poll the job until it RUNS with an endpoint; JobFailedError if it ends first,
    UnavailableError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        job = get_job(job_id)
        if job.state == "RUNNING" and job.endpoint:
            return job
        if job.done:
            raise JobFailedError(
                f"session job {job_id} ended {job.state} before serving: {job.reason}",
                reason=job.state,
            )
        if time.monotonic() > deadline:
            why = (
                f"position {job.queue_position} in the queue: {job.queue_reason}"
                if job.queue_reason
                else "no free device, or the model is slow to load"
            )
            raise UnavailableError(
                f"session job {job_id} is still {job.state} after {timeout:g} s ({why}); "
                "cancel it or wait longer",
                code="DEADLINE_EXCEEDED",
            )
        time.sleep(poll_s)


def _loss(name: str, config: dict[str, float]) -> trainer_pb2.LossConfig:
    if name not in _LOSS_PB:
        raise ValueError(f"loss_fn must be one of {sorted(_LOSS_PB)}, got {name!r}")
    unknown = set(config) - {"clip_low_threshold", "clip_high_threshold", "kl_coeff"}
    if unknown:
        raise ValueError(f"unknown loss option(s) {sorted(unknown)}")
    return trainer_pb2.LossConfig(loss=_LOSS_PB[name], **config)


def _forward_output(r: Any) -> ForwardOutput:
    return ForwardOutput(
        loss=r.loss, logprobs=[list(o.logprobs) for o in r.outputs], metrics=dict(r.metrics)
    )


def _sample_output(r: trainer_pb2.SampleResponse) -> SampleOutput:
    return SampleOutput(
        sequences=[
            SampledSequence(
                list(s.tokens),
                list(s.logprobs),
                s.stop_reason,
                _top_rows(s.topk_token_ids, s.topk_logprobs, len(s.tokens)),
            )
            for s in r.sequences
        ],
        policy_version=r.policy_version,
        prompt_logprobs=list(r.prompt_logprobs),
        prompt_top_logprobs=_top_rows(
            r.topk_prompt_token_ids, r.topk_prompt_logprobs, len(r.prompt_logprobs)
        ),
    )


def _top_rows(
    ids: Sequence[int], logprobs: Sequence[float], rows: int
) -> list[list[tuple[int, float]]]:
    """Flat row-major top-k ids and logprobs as ``rows`` lists of (id, logprob)."""
    if not ids or not rows:
        return []
    k = len(ids) // rows
    pairs = list(zip(ids, logprobs, strict=True))
    return [pairs[i * k : (i + 1) * k] for i in range(rows)]
