"""The session's sampler: the job's rollout engine, fed the trainer's weights on request.

``publish`` sends the current weights as a new policy version through the Rollout stream and
proves the engine serves them (logprobs of the probe sequence match the trainer's within the
tolerance); ``sample`` asks the same rollout for raw token samples (RolloutService.SampleTokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from opentinker.common.v1 import common_pb2
from opentinker.errors import UnavailableError, from_rpc_error
from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc

from ..errors import WeightSyncError
from ..policy import Policy
from ..rollout_client import GrpcRolloutSession


@dataclass(frozen=True)
class Sample:
    """One completion: tokens (stop token included), their sampling logprobs, and whether a
    stop/eos token ended it (else the token budget)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


def probe_difference(sent: Sequence[float], expected: Sequence[float], version: int) -> float:
    """Max |Δlogprob| between the rollout's probe answer and the trainer's own; raises
    WeightSyncError when their lengths differ."""
    if len(sent) != len(expected):
        raise WeightSyncError(
            f"rollout returned {len(sent)} probe logprobs for policy version {version}, "
            f"expected {len(expected)}"
        )
    return max((abs(a - b) for a, b in zip(sent, expected, strict=True)), default=0.0)


class SessionSampler:
    """Sampling through the job's rollout over ``channel`` (its job token attached)."""

    def __init__(self, channel: grpc.aio.Channel, *, address: str, tolerance: float) -> None:
        self._stream = GrpcRolloutSession(channel, address=address)
        self._stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        self._address = address
        self._tolerance = tolerance
        self.policy_version = 0

    async def open(self, *, job_id: str, model: common_pb2.ModelSpec, seed: int, timeout_s: float):
        await self._stream.open_sampling_only(
            job_id=job_id, model=model, seed=seed, timeout_s=timeout_s
        )

    async def publish(self, policy: Policy, *, timeout_s: float) -> float:
        """Serve ``policy``'s weights as the next version; returns the probe's max |Δlogprob|."""
        version = self.policy_version + 1
        ids = policy.probe_token_ids
        ack = await self._stream.sync_weights(
            policy.trainable_state(),
            policy_version=version,
            is_adapter=policy.is_lora,
            probe_token_ids=ids,
            timeout_s=timeout_s,
        )
        expected = await asyncio.to_thread(policy.probe_logprobs, ids)
        if ack.policy_version != version:
            raise WeightSyncError(
                f"rollout applied policy version {ack.policy_version}, the trainer sent {version}"
            )
        diff = probe_difference(ack.probe_logprobs, expected, version)
        if not diff <= self._tolerance:  # also catches nan
            raise WeightSyncError(
                f"the sampler serves different weights: max |Δlogprob| = {diff:.3g} on the "
                f"probe after sending version {version} (tolerance {self._tolerance:g})"
            )
        self.policy_version = version
        return diff

    async def sample(
        self,
        prompt: Sequence[int],
        *,
        num_samples: int,
        sampling: common_pb2.SamplingParams,
        stop_token_ids: Sequence[int],
        seed: int,
        timeout_s: float,
    ) -> tuple[list[Sample], int]:
        """Completions of ``prompt`` and the policy version that made them."""
        request = rollout_pb2.SampleTokensRequest(
            prompt_tokens=list(prompt),
            num_samples=num_samples,
            sampling=sampling,
            stop_token_ids=list(stop_token_ids),
            seed=seed,
        )
        try:
            reply = await self._stub.SampleTokens(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err)  # the rollout's INVALID_ARGUMENT etc. pass through
            if isinstance(error, UnavailableError):
                error.message = f"the session's rollout at {self._address}: {error.message}"
            raise error from err
        samples = [Sample(list(s.token_ids), list(s.logprobs), s.stopped) for s in reply.samples]
        return samples, reply.policy_version

    async def close(self, *, reason: str, timeout_s: float) -> None:
        await self._stream.close(reason=reason, timeout_s=timeout_s)
