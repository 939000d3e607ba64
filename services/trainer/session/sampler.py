"""The session's sampler: the job's rollout engine, fed the trainer's weights on request.

``publish`` sends the current weights as a new policy version through the Rollout stream and
proves the engine serves them (logprobs of the probe sequence match the trainer's within the
tolerance); ``sample`` asks the same rollout for raw token samples (RolloutService.SampleTokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from opentinker.common.v1 import common_pb2
from opentinker.errors import UnavailableError, from_rpc_error
from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from opentinker.services.trainer.errors import RolloutError, WeightSyncError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
from opentinker.services.trainer.rollout_link.weight_sync import SyncResult, verified_sync
from opentinker.services.trainer.rollout_link.weight_transport import TransportSetting
from opentinker.services.trainer.session.snapshots import Snapshot


@dataclass(frozen=True)
class Sample:
    """One completion: tokens (stop token included), their sampling logprobs, and whether a
    stop/eos token ended it (else the token budget)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


class SessionSampler:
    """Sampling through the job's rollout over ``channel`` (its job token attached)."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        address: str,
        tolerance: float | None,
        weight_transport: TransportSetting = "auto",
    ) -> None:
        self._channel, self._weight_transport = channel, weight_transport
        self._address = address
        self._stream = self._new_stream()
        self._stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        self._tolerance = tolerance
        self.policy_version = 0  # the newest version published
        self.served_version = 0  # the version the engine serves now (a snapshot's, maybe)
        self._opened_with: tuple[str, common_pb2.ModelSpec, int] | None = None
        self._broken = False  # the last sync failed: the stream may be cancelled or mid-update

    def _new_stream(self) -> GrpcRolloutSession:
        return GrpcRolloutSession(
            self._channel, address=self._address, weight_transport=self._weight_transport
        )

    async def open(self, *, job_id: str, model: common_pb2.ModelSpec, seed: int, timeout_s: float):
        self._opened_with = (job_id, model, seed)
        await self._open_stream(timeout_s)

    async def _open_stream(self, timeout_s: float) -> None:
        assert self._opened_with is not None, "open() first"
        job_id, model, seed = self._opened_with
        await self._stream.open_sampling_only(
            job_id=job_id, model=model, seed=seed, timeout_s=timeout_s
        )

    async def publish(self, policy: Policy, *, timeout_s: float) -> SyncResult:
        """Serve ``policy``'s weights as the next version; returns the verified sync (the
        probe's max |Δlogprob|, the trainer's probe answer, the tolerance held to)."""
        result = await self.serve(policy, self.policy_version + 1, timeout_s=timeout_s)
        self.policy_version = self.served_version
        return result

    async def serve(
        self,
        source: Policy | Snapshot,
        version: int,
        *,
        timeout_s: float,
        tolerance: float | None = None,
    ) -> SyncResult:
        """Serve ``source``'s trainable weights as ``version`` (verified). After a failed
        sync (a timeout or a broken stream cancels the stream) it first opens a fresh
        stream, which then gets every weight."""
        if self._broken:
            await self._stream.close(reason="weight sync failed", timeout_s=timeout_s)
            self._stream = self._new_stream()
            await self._open_stream(timeout_s)
            self._broken = False
        try:
            result = await verified_sync(
                self._stream,
                source,  # type: ignore[arg-type]  # a Snapshot quacks as a Policy here
                version=version,
                tolerance=self._tolerance if tolerance is None else tolerance,
                timeout_s=timeout_s,
            )
        except (RolloutError, WeightSyncError):
            self._broken = True
            self.served_version = 0  # the engine may hold part of it: sync again before use
            raise
        self.served_version = version
        return result

    async def sample(
        self,
        prompt: Sequence[int],
        *,
        num_samples: int,
        sampling: common_pb2.SamplingParams,
        stop_token_ids: Sequence[int],
        seed: int,
        timeout_s: float,
        greedy: bool = False,
    ) -> tuple[list[Sample], int]:
        """Completions of ``prompt`` and the policy version that made them."""
        request = rollout_pb2.SampleTokensRequest(
            prompt_tokens=list(prompt),
            num_samples=num_samples,
            sampling=sampling,
            stop_token_ids=list(stop_token_ids),
            seed=seed,
            greedy=greedy,
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

    async def score(self, tokens: Sequence[int], *, timeout_s: float) -> list[float]:
        """logprob(tokens[i+1] | tokens[:i+1]) under the served weights."""
        return list((await self._score(tokens, 0, timeout_s)).logprobs)

    async def score_top(
        self, tokens: Sequence[int], k: int, *, timeout_s: float
    ) -> tuple[list[int], list[float]]:
        """The k likeliest next tokens at each position but the last, under the served
        weights: ids and logprobs, flat row-major (len(tokens) - 1 rows of k)."""
        reply = await self._score(tokens, k, timeout_s)
        return list(reply.top_token_ids), list(reply.top_logprobs)

    async def _score(
        self, tokens: Sequence[int], top_k: int, timeout_s: float
    ) -> rollout_pb2.ScoreTokensResponse:
        request = rollout_pb2.ScoreTokensRequest(token_ids=list(tokens), top_k=top_k)
        try:
            return await self._stub.ScoreTokens(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err

    async def close(self, *, reason: str, timeout_s: float) -> None:
        await self._stream.close(reason=reason, timeout_s=timeout_s)
