"""The trainer's side of the RolloutService.Rollout stream, behind plain async methods.

One request, one answer, in order: open -> opened, weights -> applied, collect -> batch,
close -> closed. Training batches may be requested ahead (``request_batch``; the RL loop's
bounded staleness): the rollout serves its stream in order, so their batches come back before
the answers to anything sent after them, and are kept until ``receive_batch`` asks. Every wait
has a deadline; heartbeats from the rollout are skipped; a RolloutFailed, an ended stream or a
gRPC error raises RolloutError at once, naming the rollout.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from opentinker.common.v1 import common_pb2
from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from opentinker.services.modeling.weights import ChangedTensors, pack_weights
from opentinker.services.trainer.errors import RolloutError
from opentinker.services.trainer.rl.batch import CollectedBatch
from opentinker.services.trainer.rollout_link.rollout_wire import (
    episode_from_proto,
    eval_row,
    open_request,
)
from opentinker.services.trainer.rollout_link.weight_transport import (
    StreamTransport,
    TransportSetting,
)
from opentinker.spec import JobSpec


@dataclass(frozen=True)
class WeightsAck:
    """The rollout's answer to a weight update: the version it now serves and the probe."""

    policy_version: int
    probe_logprobs: list[float]
    apply_seconds: float


class GrpcRolloutSession:
    """A Rollout stream to ``address``. Create, then ``await open(...)`` first."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        address: str,
        weight_transport: TransportSetting = "auto",
    ) -> None:
        """weight_transport: "auto" offers the rollout shared memory / CUDA IPC for weight
        updates (taken when it runs on this host), "grpc" sends the bytes inline only."""
        self._stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        self._address = address
        self._call: grpc.aio.StreamStreamCall | None = None
        self._seq = 0
        self._seed = 0  # the session's seed: evaluation rows name their env seeds
        self.roles: tuple[str, ...] = ()  # the env's roles (multi-agent self-play), once open
        self._requested: deque[int] = deque()  # training batches asked for, not yet received
        self._arrived: deque[rollout_pb2.TrajectoryBatch] = deque()  # ..of which here already
        self._parts: list[rollout_pb2.TrajectoryBatch] = []  # of a batch sent in parts
        self._batch_timeout_s = 0.0  # the deadline of a requested batch
        self._sent = ChangedTensors()  # what the rollout of this stream already serves
        self.transport = StreamTransport(weight_transport)

    async def open(self, *, job_id: str, spec: JobSpec, timeout_s: float) -> str:
        """Open the session for ``spec``'s model and env (an RL or an inference job);
        returns the engine name."""
        request = open_request(job_id, spec)
        self._seed = request.seed
        reply = await self._open(request, timeout_s)
        self.roles = tuple(reply.roles)
        return reply.engine

    async def open_sampling_only(
        self, *, job_id: str, model: common_pb2.ModelSpec, seed: int, timeout_s: float
    ) -> str:
        """Open for a training session: the rollout loads ``model`` and only samples
        (SampleTokens) and takes weight updates, with no environment; returns the engine."""
        request = rollout_pb2.OpenRollout(job_id=job_id, model=model, seed=seed, sampling_only=True)
        return (await self._open(request, timeout_s)).engine

    async def _open(
        self, request: rollout_pb2.OpenRollout, timeout_s: float
    ) -> rollout_pb2.RolloutOpened:
        """A new stream, opened with the weight transports offered (weight_transport.py)."""
        self._call = self._stub.Rollout()
        self._sent.forget()  # a new stream may reach a new rollout
        self._parts = []
        offer = self.transport.offer()
        if offer is not None:
            request.weight_offer.CopyFrom(offer)
        opened = None
        try:
            await self._send(rollout_pb2.RolloutRequest(open=request), timeout_s)
            opened = (await self._receive("opened", timeout_s)).opened
        finally:
            self.transport.opened(opened)
        return opened

    async def sync_weights(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        policy_version: int,
        is_adapter: bool,
        probe_token_ids: list[int],
        timeout_s: float,
        after_send: Callable[[], Awaitable[None]] | None = None,
    ) -> WeightsAck:
        """Send one weight update in chunks and wait until the rollout has applied it. Only the
        tensors changed since the last acknowledged update travel (all of them the first time
        on this stream); the rollout keeps the others. after_send: awaited once the last chunk
        is written, before the wait (to send requests that the rollout must serve with these
        weights)."""
        changed, stamps = self._sent.changed(tensors)
        path = self.transport.pick(changed)
        ok = False
        try:
            await self._send_update(
                changed, path, policy_version, is_adapter, probe_token_ids, timeout_s
            )
            if after_send is not None:
                await after_send()
            applied = (await self._receive_update(path, timeout_s)).applied
            ok = True
        finally:
            self.transport.update_done(path, ok)
        if applied.policy_version == policy_version:
            self._sent.acknowledge(stamps)
        return WeightsAck(
            applied.policy_version, list(applied.probe_logprobs), applied.apply_seconds
        )

    async def _send_update(
        self,
        changed: Mapping[str, torch.Tensor],
        path: int,
        policy_version: int,
        is_adapter: bool,
        probe_token_ids: list[int],
        timeout_s: float,
    ) -> None:
        """The chunks of one update over ``path`` (a WeightTransport)."""

        async def send(request: rollout_pb2.RolloutRequest) -> int:
            await self._send(request, timeout_s)
            return self._seq

        header = rollout_pb2.WeightChunk(
            policy_version=policy_version, is_adapter=is_adapter, probe_token_ids=probe_token_ids
        )
        if path == rollout_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY:
            await self.transport.send_shared(
                changed,
                header=header,
                send=send,
                receive_taken=lambda: self._receive_taken(policy_version, timeout_s),
            )
        elif path == rollout_pb2.WEIGHT_TRANSPORT_CUDA_IPC:
            await self.transport.send_cuda_ipc(changed, header=header, send=send)
        else:
            for chunk in pack_weights(
                changed,
                policy_version=policy_version,
                is_adapter=is_adapter,
                probe_token_ids=probe_token_ids,
            ):
                await send(rollout_pb2.RolloutRequest(weights=chunk))

    async def _receive_taken(
        self, policy_version: int, timeout_s: float
    ) -> rollout_pb2.WeightChunkTaken:
        taken = (await self._receive("taken", timeout_s)).taken
        if taken.policy_version != policy_version:
            raise RolloutError(
                f"rollout at {self._address} released a chunk of version "
                f"{taken.policy_version} during the update to {policy_version}"
            )
        return taken

    async def _receive_update(self, path: int, timeout_s: float) -> rollout_pb2.RolloutResponse:
        """WeightsApplied; with shared memory, the chunks still in flight are released first."""
        while path == rollout_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY:
            reply = await self._receive(("taken", "applied"), timeout_s)
            if reply.WhichOneof("payload") == "applied":
                return reply
            self.transport.taken(reply.taken.request_seq)
        return await self._receive("applied", timeout_s)

    async def collect(
        self, *, batch_index: int, num_groups: int, group_size: int, timeout_s: float
    ) -> CollectedBatch:
        """Ask for num_groups x group_size episodes and wait for the batch."""
        await self.request_batch(
            batch_index=batch_index,
            num_groups=num_groups,
            group_size=group_size,
            timeout_s=timeout_s,
        )
        return await self.receive_batch(batch_index=batch_index, timeout_s=timeout_s)

    async def request_batch(
        self, *, batch_index: int, num_groups: int, group_size: int, timeout_s: float
    ) -> None:
        """Ask for a training batch now; the rollout plays it with the weights it serves once
        the requests before it are done (weights sent later apply after it)."""
        request = rollout_pb2.CollectTrajectories(
            batch_index=batch_index, num_groups=num_groups, group_size=group_size
        )
        await self._send(rollout_pb2.RolloutRequest(collect=request), timeout_s)
        self._requested.append(batch_index)
        self._batch_timeout_s = timeout_s

    async def receive_batch(self, *, batch_index: int, timeout_s: float) -> CollectedBatch:
        """The oldest requested training batch (which must be ``batch_index``)."""
        if not self._requested:
            raise RolloutError(f"batch {batch_index} was never requested from {self._address}")
        if self._arrived:
            batch = self._arrived.popleft()
        else:
            batch = (await self._receive("batch", timeout_s, keep_training=False)).batch
        self._requested.popleft()
        if batch.batch_index != batch_index:
            raise RolloutError(
                f"rollout at {self._address} answered batch {batch.batch_index}, "
                f"expected {batch_index}"
            )
        return CollectedBatch(
            episodes=[episode_from_proto(t) for t in batch.trajectories],
            generate_seconds=batch.generate_seconds,
            env_seconds=batch.env_seconds,
            generated_tokens=batch.generated_tokens,
        )

    async def evaluate(
        self,
        *,
        batch_index: int,
        first_episode: int,
        episodes: int,
        temperature: float,
        timeout_s: float,
        samples: int = 1,
    ) -> list[dict[str, Any]]:
        """Play evaluation episodes ``first_episode ..`` (temperature 0 = greedy), each
        ``samples`` times; one result row each (opentinker.inference_rows, texts cut to the
        wire limits), in episode order."""
        request = rollout_pb2.CollectTrajectories(
            batch_index=batch_index,
            num_groups=episodes,
            group_size=samples,
            evaluation=True,
            first_episode=first_episode,
            eval_temperature=temperature,
        )
        await self._send(rollout_pb2.RolloutRequest(collect=request), timeout_s)
        batch = (await self._receive("batch", timeout_s)).batch
        games = len({t.episode_id for t in batch.trajectories})  # self-play: a row per role
        if batch.batch_index != batch_index or games != episodes * samples:
            raise RolloutError(
                f"rollout at {self._address} answered evaluation batch {batch.batch_index} with "
                f"{games} episodes, expected {batch_index} with {episodes * samples}"
            )
        return [eval_row(t, self._seed) for t in batch.trajectories]

    async def close(self, *, reason: str, timeout_s: float) -> None:
        """Send CloseRollout and wait for RolloutClosed (or the stream's end); never raises."""
        self.transport.close()
        if self._call is None:
            return
        call, self._call = self._call, None
        if call.done():
            return
        try:
            self._seq += 1
            close = rollout_pb2.RolloutRequest(
                seq=self._seq, close=rollout_pb2.CloseRollout(reason=reason)
            )
            await asyncio.wait_for(call.write(close), timeout_s)
            await asyncio.wait_for(call.done_writing(), timeout_s)
            while True:
                reply = await asyncio.wait_for(call.read(), timeout_s)
                if reply is grpc.aio.EOF or reply.WhichOneof("payload") in ("closed", "failed"):
                    break
        except (grpc.RpcError, TimeoutError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # the stream is gone already: nothing left to close
        finally:
            call.cancel()

    async def _send(self, request: rollout_pb2.RolloutRequest, timeout_s: float) -> None:
        if self._call is None:
            raise RolloutError(f"rollout session to {self._address} is not open")
        self._seq += 1
        request.seq = self._seq
        kind = request.WhichOneof("payload")
        try:
            await asyncio.wait_for(self._call.write(request), timeout_s)
        except TimeoutError as err:
            raise RolloutError(
                f"rollout at {self._address} did not take a {kind!r} message "
                f"within {timeout_s:.0f} s"
            ) from err
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            raise await self._stream_error(err, f"sending {kind!r}") from err

    async def _receive(
        self, expected: str | tuple[str, ...], timeout_s: float, *, keep_training: bool = True
    ) -> rollout_pb2.RolloutResponse:
        """The next reply of kind ``expected`` (or of one of them). With ``keep_training``, the
        batches of training collects requested earlier (they arrive first) are kept for
        receive_batch, and their deadline adds to this wait's."""
        assert self._call is not None
        loop = asyncio.get_running_loop()
        ahead = keep_training and len(self._arrived) < len(self._requested)
        deadline = loop.time() + timeout_s + (self._batch_timeout_s if ahead else 0.0)
        while True:
            try:
                reply = await asyncio.wait_for(self._call.read(), max(deadline - loop.time(), 0.0))
            except TimeoutError as err:
                raise RolloutError(
                    f"rollout at {self._address} sent no {expected!r} within {timeout_s:.0f} s"
                ) from err
            except grpc.RpcError as err:
                raise await self._stream_error(err, f"waiting for {expected!r}") from err
            if reply is grpc.aio.EOF:
                raise RolloutError(
                    f"rollout at {self._address} ended the stream while the trainer waited "
                    f"for {expected!r}"
                )
            kind = reply.WhichOneof("payload")
            if kind == "batch" and not self._joined(reply.batch):
                continue  # a part of a batch too large for one message: the rest follows
            if kind == "batch" and keep_training and len(self._arrived) < len(self._requested):
                self._arrived.append(reply.batch)
                continue
            if kind in ((expected,) if isinstance(expected, str) else expected):
                return reply
            if kind == "heartbeat":
                continue
            if kind == "failed":
                code = f" ({reply.failed.code})" if reply.failed.code else ""
                raise RolloutError(
                    f"rollout failed{code}: {reply.failed.reason}", code=reply.failed.code
                )
            raise RolloutError(
                f"rollout at {self._address} sent {kind!r} while the trainer waited "
                f"for {expected!r}"
            )

    def _joined(self, batch: rollout_pb2.TrajectoryBatch) -> bool:
        """Whether ``batch`` is whole: a batch too large for one message comes in parts (all
        but the last with ``more`` set), kept until the last arrives and joined into it."""
        if self._parts and self._parts[0].batch_index != batch.batch_index:
            raise RolloutError(
                f"rollout at {self._address} sent a part of batch {batch.batch_index} before "
                f"the rest of batch {self._parts[0].batch_index}"
            )
        if batch.more:
            self._parts.append(batch)
            return False
        if self._parts:
            parts, self._parts = self._parts, []
            whole = rollout_pb2.TrajectoryBatch()
            for part in [*parts, batch]:
                whole.MergeFrom(part)  # trajectories in order; the figures are the last's
            whole.more = False
            batch.CopyFrom(whole)
        return True

    async def _stream_error(self, err: Exception, doing: str) -> RolloutError:
        """RolloutError with the call's final status (a write to an ended call says only that)."""
        if isinstance(err, grpc.RpcError):
            code, details = err.code(), err.details()
        elif self._call is not None and self._call.done():
            code, details = await self._call.code(), await self._call.details()
        else:
            return RolloutError(f"rollout stream to {self._address} is closed ({doing}): {err}")
        name = code.name if code is not None else "UNKNOWN"
        return RolloutError(
            f"rollout at {self._address} unreachable or broken while {doing}: {name}: {details}",
            code=name,
        )
