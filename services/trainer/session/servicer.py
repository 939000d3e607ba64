"""TrainerService's session calls <-> a TrainingSession. Thin: checks who calls, turns
protobuf into domain types and domain errors into status codes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import structlog

from opentinker.errors import InvalidArgumentError, NotFoundError, OpenTinkerError
from opentinker.services.common.auth import current_principal
from opentinker.services.common.grpc_server import abort, abort_with
from opentinker.services.trainer.errors import RolloutError, WeightSyncError
from opentinker.services.trainer.session.data import Datum
from opentinker.services.trainer.session.objective import (
    DEFAULT_CLIP_HIGH,
    DEFAULT_CLIP_LOW,
    LossSpec,
)
from opentinker.services.trainer.session.topk import add_topk, check_topk
from opentinker.services.trainer.session.training_session import AdamParams, TrainingSession
from opentinker.spec import JobSpec, to_proto
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

log = structlog.get_logger(__name__)
T = TypeVar("T")
_LOSS_NAMES = {
    trainer_pb2.SESSION_LOSS_CROSS_ENTROPY: "cross_entropy",
    trainer_pb2.SESSION_LOSS_IMPORTANCE_SAMPLING: "importance_sampling",
    trainer_pb2.SESSION_LOSS_PPO: "ppo",
    trainer_pb2.SESSION_LOSS_CISPO: "cispo",
    trainer_pb2.SESSION_LOSS_GSPO: "gspo",
    trainer_pb2.SESSION_LOSS_STABLE_REINFORCE: "stable_reinforce",
    trainer_pb2.SESSION_LOSS_DRO: "dro",
}


class SessionServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """The session API of one session job (GetTrainerStatus answers from the session too)."""

    def __init__(self, session: TrainingSession) -> None:
        self._s = session

    async def _run(
        self,
        call: trainer_pb2.SessionCall,
        context: grpc.aio.ServicerContext,
        body: Callable[[], Awaitable[T]],
    ) -> T:
        """Admit the caller for ``call.session_id``, then run ``body`` as call ``call.seq``."""
        await self._admit(call.session_id, context)
        try:
            async with self._s.call(call.seq):
                return await body()
        except (RolloutError, WeightSyncError) as err:
            await abort(context, grpc.StatusCode.UNAVAILABLE, err.message, reason="SAMPLER")
        except ValueError as err:  # a loss refusing its arguments (e.g. ppo thresholds)
            if isinstance(err, OpenTinkerError):
                await abort_with(context, err)
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err), reason="BAD_LOSS")
        except OpenTinkerError as err:
            await abort_with(context, err)
        except Exception as err:  # a bug or a torch error: a clear INTERNAL, and the log
            log.exception("session_call_crashed", seq=call.seq)
            await abort(
                context,
                grpc.StatusCode.INTERNAL,
                f"trainer error in call {call.seq}: {type(err).__name__}: {err}",
                reason="TRAINER_ERROR",
            )

    async def _admit(self, session_id: str, context: grpc.aio.ServicerContext) -> None:
        """The job's own token, or a user of the job's tenant; anyone else learns nothing
        (NOT_FOUND, as for a session that does not exist)."""
        p = current_principal()
        owner = (p.kind == "job" and p.job_id == self._s.job_id) or (
            p.kind == "user" and p.sees(self._s.tenant_id)
        )
        if session_id != self._s.job_id or not owner:
            await abort_with(
                context,
                NotFoundError(
                    f"no session {session_id!r} here for {p.describe()}", reason="NO_SESSION"
                ),
            )

    async def Forward(self, request, context):  # noqa: N802 - gRPC method name
        async def body():
            result = await _to_the_end(self._s.forward(_data(request.data), _loss(request.loss)))
            return trainer_pb2.ForwardResponse(
                loss=float(result.loss),
                outputs=[trainer_pb2.DatumOutput(logprobs=lp) for lp in result.logprobs],
                metrics=result.metrics,
            )

        return await self._run(request.call, context, body)

    async def ForwardBackward(self, request, context):  # noqa: N802
        async def body():
            work = self._s.forward_backward(_data(request.data), _loss(request.loss))
            result = await _to_the_end(work)
            return trainer_pb2.ForwardBackwardResponse(
                loss=float(result.loss.detach()),
                outputs=[trainer_pb2.DatumOutput(logprobs=lp) for lp in result.logprobs],
                metrics=result.metrics,
                accumulated_calls=self._s.accumulated_calls,
            )

        return await self._run(request.call, context, body)

    async def OptimStep(self, request, context):  # noqa: N802
        async def body():
            step, grad_norm = await _to_the_end(self._s.optim_step(adam_from_proto(request.adam)))
            return trainer_pb2.OptimStepResponse(
                step=step, grad_norm=grad_norm, metrics={"grad_norm": grad_norm}
            )

        return await self._run(request.call, context, body)

    async def Sample(self, request, context):  # noqa: N802
        async def body():
            check_topk(request)
            samples, version = await self._s.sample(
                list(request.prompt_tokens),
                num_samples=request.num_samples,
                sampling=request.sampling,
                stop_token_ids=list(request.stop_token_ids),
                seed=request.seed,
                seq=request.call.seq,
                policy_version=request.policy_version,
                greedy=request.greedy,
            )
            sequences = [
                trainer_pb2.SampledSequence(
                    tokens=s.tokens,
                    logprobs=s.logprobs,
                    stop_reason="stop" if s.stopped else "length",
                )
                for s in samples
            ]
            prompt_logprobs = (
                await self._s.prompt_logprobs(list(request.prompt_tokens))
                if request.include_prompt_logprobs
                else []
            )
            response = trainer_pb2.SampleResponse(
                sequences=sequences, policy_version=version, prompt_logprobs=prompt_logprobs
            )
            timeout_s = self._s.settings.collect_timeout_s
            await add_topk(self._s.sampler, request, response, timeout_s=timeout_s)
            return response

        return await self._run(request.call, context, body)

    async def SaveWeightsForSampler(self, request, context):  # noqa: N802
        async def body():
            version, diff = await self._s.save_weights_for_sampler()
            return trainer_pb2.SaveWeightsForSamplerResponse(
                policy_version=version, probe_max_diff=diff
            )

        return await self._run(request.call, context, body)

    async def SaveState(self, request, context):  # noqa: N802
        async def body():
            path = await _to_the_end(self._s.save_state(request.name))
            return trainer_pb2.SaveStateResponse(path=str(path))

        return await self._run(request.call, context, body)

    async def LoadState(self, request, context):  # noqa: N802
        async def body():
            step = await _to_the_end(self._s.load_state(request.path))
            return trainer_pb2.LoadStateResponse(step=step)

        return await self._run(request.call, context, body)

    async def CloseSession(self, request, context):  # noqa: N802
        async def body():
            self._s.end("closed")
            return trainer_pb2.CloseSessionResponse()

        return await self._run(request.call, context, body)

    async def GetSessionInfo(self, request, context):  # noqa: N802
        await self._admit(request.session_id, context)
        s = self._s
        return trainer_pb2.GetSessionInfoResponse(
            session_id=s.job_id,
            model=to_proto(JobSpec(kind="session", model=s.policy.spec)).model,
            step=s.step,
            policy_version=s.sampler.policy_version,
            last_seq=s.last_seq,
            accumulated_calls=s.accumulated_calls,
            trainable_parameters=s.policy.num_trainable_parameters(),
            idle_timeout_s=s.config.idle_timeout_s,
        )

    async def GetTrainerStatus(self, request, context):  # noqa: N802
        await self._admit(self._s.job_id, context)
        s = self._s
        return trainer_pb2.GetTrainerStatusResponse(
            job_id=s.job_id,
            step=s.step,
            policy_version=s.sampler.policy_version,
            trainable_parameters=s.policy.num_trainable_parameters(),
        )


async def _to_the_end(work: Awaitable[T]) -> T:
    """Await the model work of a call in a task of its own: a call the client gives up on
    (its deadline, a cancel) still finishes what it started -- the work in its thread and the
    session's count of it -- before its turn ends, so the next call never runs alongside it
    nor finds its gradients uncounted. (Sampling calls change no training state: a cancel
    ends them at once.)"""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            log.warning("cancelled_call_failed", error=str(task.exception()))
        raise


def _data(data) -> list[Datum]:
    return [
        Datum(
            input_tokens=list(d.input_tokens),
            target_tokens=list(d.target_tokens),
            weights=list(d.weights),
            sampling_logprobs=list(d.sampling_logprobs),
            advantages=list(d.advantages),
            sequence_ratio_mask=list(d.sequence_ratio_mask),
        )
        for d in data
    ]


def _loss(pb: trainer_pb2.LossConfig) -> LossSpec:
    name = _LOSS_NAMES.get(pb.loss)
    if name is None:
        raise InvalidArgumentError(
            f"loss.loss: choose one of {sorted(_LOSS_NAMES.values())}", reason="BAD_LOSS"
        )
    if pb.kl_coeff < 0:
        raise InvalidArgumentError(f"loss.kl_coeff: must be >= 0, got {pb.kl_coeff:g}")
    return LossSpec(
        name=name,  # type: ignore[arg-type]  # one of the LossName literals
        clip_low=pb.clip_low_threshold or DEFAULT_CLIP_LOW,
        clip_high=pb.clip_high_threshold or DEFAULT_CLIP_HIGH,
        kl_coeff=pb.kl_coeff,
    )


def adam_from_proto(a: trainer_pb2.AdamParams) -> AdamParams:
    """The call's AdamW settings: beta1, beta2 and eps as given when set (0 too), else the
    defaults 0.9 / 0.95 / 1e-8 (``a.beta1 or 0.9`` turned a beta1 of 0 into 0.9)."""
    return AdamParams(
        learning_rate=a.learning_rate,
        beta1=a.beta1 if a.HasField("beta1") else 0.9,
        beta2=a.beta2 if a.HasField("beta2") else 0.95,
        eps=a.eps if a.HasField("eps") else 1e-8,
        weight_decay=a.weight_decay,
        grad_clip_norm=a.grad_clip_norm,
    )
