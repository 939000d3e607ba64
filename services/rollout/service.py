"""The RolloutService gRPC servicer: the trainer's Rollout stream <-> a RolloutSession.

Thin: it turns envelopes into session calls and results (or typed errors) into envelopes.
Heartbeats are answered at once by the reader task while a batch is being collected.

A private rollout serves one job (it admits only that job's token). A shared one
(``shared=``: many LoRA jobs of one base model on one engine, shared_engine.py) admits any job
token the scheduler vouches for; each stream then opens only its caller's own job, and
SampleTokens/ScoreTokens reach only the caller's own session.

A trainer that leaves an opened stream without its CloseRollout (the stream cut because it did
not answer keepalive pings, a SIGSTOP or a frozen host, or its connection broke) is lost:
``on_trainer_lost`` is told why (a private rollout's main then exits exit_codes.PEER_LOST).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from opentinker.auth import credential_from_metadata
from opentinker.errors import (
    FailedPreconditionError,
    OpenTinkerError,
    PermissionDeniedError,
)
from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from opentinker.services.common.auth import (
    JOBS,
    USERS,
    Authenticator,
    AuthInterceptor,
    OwnCredentialAuthenticator,
    current_principal,
    rules_for,
)
from opentinker.services.common.grpc_server import abort_with, create_aio_server, mark_serving
from opentinker.services.modeling.weights import WeightStream
from opentinker.services.rollout.config import RolloutConfig, config_from_proto, sampling_from_proto
from opentinker.services.rollout.engines.engine_choice import default_engine_factory
from opentinker.services.rollout.engines.weight_transports import IncomingWeights, accept_offer
from opentinker.services.rollout.session import EngineFactory, RolloutSession
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.shared.shared_engine import SharedAdapters, Tenancy
from opentinker.services.rollout.wire import batch_parts, code_of, failed, heartbeat

log = structlog.get_logger("opentinker.rollout.service")

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
_TERMINAL = ("failed", "closed")
TRAINER_LEFT = (
    "the trainer left its stream without closing it (it stopped answering keepalive pings, "
    "or went away)"
)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        settings: RolloutSettings,
        engine_factory: EngineFactory,
        *,
        shared: SharedAdapters | None = None,
        on_trainer_lost: Callable[[str], None] | None = None,
    ) -> None:
        self._settings = settings
        self._on_trainer_lost = on_trainer_lost
        self._engine_factory = engine_factory
        self._shared = shared
        # The session of each caller's open Rollout stream, by the caller's job id (a private
        # rollout has one caller): SampleTokens samples with its engine and weights.
        self._sessions: dict[str, RolloutSession] = {}
        self._endings: set[asyncio.Task[None]] = set()  # streams' cleanups still running

    def _open_session(self, rpc: str) -> RolloutSession:
        session = self._sessions.get(current_principal().job_id)
        if session is None:
            raise FailedPreconditionError(f"{rpc} needs an open Rollout stream (OpenRollout first)")
        return session

    async def SampleTokens(  # noqa: N802 - the gRPC method name
        self, request: rollout_pb2.SampleTokensRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.SampleTokensResponse:
        try:
            samples, version = await self._open_session("SampleTokens").sample(
                list(request.prompt_tokens),
                num_samples=request.num_samples,
                sampling=sampling_from_proto(request.sampling),
                stop_token_ids=list(request.stop_token_ids),
                seed=request.seed,
                greedy=request.greedy,
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return rollout_pb2.SampleTokensResponse(
            samples=[
                rollout_pb2.SampledTokens(
                    token_ids=s.token_ids, logprobs=s.logprobs, stopped=s.stopped
                )
                for s in samples
            ],
            policy_version=version,
        )

    async def ScoreTokens(  # noqa: N802 - the gRPC method name
        self, request: rollout_pb2.ScoreTokensRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ScoreTokensResponse:
        try:
            session = self._open_session("ScoreTokens")
            logprobs, version = await session.score(list(request.token_ids))
            top_ids, top_logprobs = (
                await session.top_logprobs(list(request.token_ids), request.top_k)
                if request.top_k
                else ([], [])
            )
        except OpenTinkerError as err:
            await abort_with(context, err)
        return rollout_pb2.ScoreTokensResponse(
            logprobs=logprobs,
            policy_version=version,
            top_token_ids=top_ids,
            top_logprobs=top_logprobs,
        )

    async def Rollout(  # noqa: N802 - the gRPC method name
        self,
        request_iterator: AsyncIterator[rollout_pb2.RolloutRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rollout_pb2.RolloutResponse]:
        key = current_principal().job_id
        tenancy = None
        if self._shared is not None:
            try:
                tenancy = self._tenancy(context)
            except OpenTinkerError as err:
                await abort_with(context, err)
            # The job's own token reaches EnvHub for its episodes: never another job's.
            settings = self._settings.model_copy(
                update={"credential": credential_from_metadata(context.invocation_metadata())}
            )
            session = RolloutSession(settings, tenancy.engine_factory)
        else:
            session = RolloutSession(self._settings, self._engine_factory)
        stream = _RolloutStream(session, admit=tenancy.admit if tenancy else None)
        self._sessions[key] = session
        reader = asyncio.create_task(stream.read(request_iterator))
        worker = asyncio.create_task(stream.work())
        seq = itertools.count(1)
        ended = False  # a terminal answer sent (closed, failed): the stream ended as agreed
        try:
            while (response := await stream.out.get()) is not None:
                response.seq = next(seq)
                # Ended as agreed once a terminal answer is sent: the trainer, which asked to
                # close, may hang up before this generator resumes after the yield.
                ended = response.WhichOneof("payload") in _TERMINAL
                yield response
                if ended:
                    return
        finally:
            if stream.opened and not ended and self._on_trainer_lost is not None:
                self._on_trainer_lost(TRAINER_LEFT)
            if self._sessions.get(key) is session:
                del self._sessions[key]
            for task in (reader, worker):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            # A client that got its last answer may end the call at once, cancelling this
            # handler: the stream's cleanup runs as its own task, shielded, held until done.
            ending = asyncio.create_task(_end_stream(stream, session, tenancy))
            self._endings.add(ending)
            ending.add_done_callback(self._endings.discard)
            await asyncio.shield(ending)

    def _tenancy(self, context: grpc.aio.ServicerContext) -> Tenancy:
        """A shared engine's stream: only a job's own processes, one stream per job."""
        assert self._shared is not None
        caller = current_principal()
        if caller.kind != "job" or not caller.job_id:
            raise PermissionDeniedError(
                f"a shared rollout serves jobs' trainers only (their job token); you called "
                f"as {caller.describe()}",
                code="PERMISSION_DENIED",
            )
        if caller.job_id in self._sessions:
            raise FailedPreconditionError(
                f"job {caller.job_id} already has a Rollout stream open on this shared engine",
                code="FAILED_PRECONDITION",
            )
        return Tenancy(self._shared, caller.job_id)


async def _end_stream(
    stream: _RolloutStream, session: RolloutSession, tenancy: Tenancy | None
) -> None:
    """Free what a finished Rollout stream held: its shared-memory mappings, its adapter on a
    shared engine (first: other jobs may wait for the room), its episode stream to EnvHub."""
    stream.incoming.close()
    if tenancy is not None:
        await asyncio.to_thread(tenancy.release)
    await session.close()


# Weight chunks (each up to weights.DEFAULT_CHUNK_BYTES) read ahead of the one being applied.
WEIGHT_CHUNKS_AHEAD = 2


class _RolloutStream:
    """State of one Rollout stream: requests in, responses out (None ends the stream)."""

    def __init__(
        self,
        session: RolloutSession,
        *,
        admit: Callable[[RolloutConfig], None] | None = None,
    ) -> None:
        """admit: raises for an OpenRollout this stream may not make (a shared engine's)."""
        self.session = session
        self._admit = admit
        self.out: asyncio.Queue[rollout_pb2.RolloutResponse | None] = asyncio.Queue()
        self._work: asyncio.Queue[rollout_pb2.RolloutRequest | None] = asyncio.Queue()
        self._weights_stream = WeightStream()
        self.incoming = IncomingWeights()  # shared-memory / CUDA IPC updates (same host)
        self._by_reference = 0  # tensors of the update in progress not sent inline
        # Weight chunks queued but not applied yet: bounded, so a fast sender waits (gRPC flow
        # control) instead of the whole model piling up here in protobuf form.
        self._weight_slots = asyncio.Semaphore(WEIGHT_CHUNKS_AHEAD)
        self.opened = False  # the session opened (RolloutOpened sent): a trainer is on it

    async def read(self, requests: AsyncIterator[rollout_pb2.RolloutRequest]) -> None:
        """Answer heartbeats now; queue everything else for the worker, in order (at most
        WEIGHT_CHUNKS_AHEAD weight chunks)."""
        try:
            async for request in requests:
                kind = request.WhichOneof("payload")
                if kind == "heartbeat":
                    self.out.put_nowait(heartbeat())
                    continue
                if kind == "weights":
                    await self._weight_slots.acquire()  # released once handled
                self._work.put_nowait(request)
        finally:
            self._work.put_nowait(None)  # the trainer half-closed (or left): finish, then end

    async def work(self) -> None:
        while (request := await self._work.get()) is not None:
            try:
                response = await self._handle(request)
                if request.WhichOneof("payload") == "weights":
                    self._weight_slots.release()
            except OpenTinkerError as err:
                code = code_of(err)
                log.warning("rollout_failed", code=code, reason=err.message)
                response = failed(err.message, code)
            except Exception as err:  # a bug: still end the stream with a reason, never hang
                log.exception("rollout_crashed")
                response = failed(
                    f"rollout internal error: {type(err).__name__}: {err}", "INTERNAL"
                )
            if response is None:
                continue
            self.out.put_nowait(response)
            if response.WhichOneof("payload") in _TERMINAL:
                return
        self.out.put_nowait(None)

    async def _handle(
        self, request: rollout_pb2.RolloutRequest
    ) -> rollout_pb2.RolloutResponse | None:
        kind = request.WhichOneof("payload")
        if kind == "open":
            config = config_from_proto(request.open)
            if self._admit is not None:
                self._admit(config)
            engine = await self.session.open(config)
            self.opened = True
            gpus = self.session.settings.tensor_parallel_size if engine.name == "vllm" else 1
            transports, refused = await asyncio.to_thread(
                accept_offer, request.open.weight_offer, engine_gpus=gpus
            )
            return rollout_pb2.RolloutResponse(
                opened=rollout_pb2.RolloutOpened(
                    engine=engine.name,
                    policy_version=engine.policy_version,
                    roles=self.session.roles,
                    weight_transports=transports,
                    weight_transport_detail=refused,
                )
            )
        if kind == "weights":
            return await self._weights(request.weights, request.seq)
        if kind == "collect":
            c = request.collect
            if c.evaluation:
                if c.group_size < 0:
                    return failed("an evaluation collect needs group_size >= 0", "INVALID_ARGUMENT")
                batch = await self.session.evaluate(
                    c.batch_index,
                    c.num_groups,
                    first_episode=c.first_episode,
                    temperature=c.eval_temperature,
                    samples=max(1, c.group_size),  # samples of each episode (pass@k)
                )
            else:
                batch = await self.session.collect(c.batch_index, c.num_groups, c.group_size)
            *parts, last = batch_parts(batch)  # too large for one message: in parts, in a row
            for part in parts:
                self.out.put_nowait(rollout_pb2.RolloutResponse(batch=part))
            return rollout_pb2.RolloutResponse(batch=last)
        if kind == "close":
            log.info("rollout_closed", reason=request.close.reason)
            return rollout_pb2.RolloutResponse(
                closed=rollout_pb2.RolloutClosed(reason=request.close.reason)
            )
        return failed(f"unknown or empty RolloutRequest payload {kind!r}", "INVALID_ARGUMENT")

    async def _weights(
        self, chunk: rollout_pb2.WeightChunk, seq: int
    ) -> rollout_pb2.RolloutResponse | None:
        """Apply the tensors each chunk completes at once (streamed, in place: the served
        weights are mixed until the last chunk, and nothing else runs on this stream
        meanwhile); the last chunk sets the version and answers with the probe. A chunk in
        shared memory is copied from the segment and answered (WeightChunkTaken)."""
        updates = self.session.weight_updates("a weight chunk")
        try:
            tensors = self._weights_stream.add(chunk)
        except (ValueError, RuntimeError) as err:  # torch raises RuntimeError on a bad reshape
            self._weights_stream = WeightStream()
            return failed(f"malformed weight chunk: {err}", "INVALID_ARGUMENT")
        self._by_reference += len(chunk.shared) + len(chunk.cuda_ipc)
        if chunk.cuda_ipc:
            await updates.load_cuda_ipc(list(chunk.cuda_ipc))
        if not chunk.last:
            try:
                tensors |= self.incoming.shared(chunk)
                if tensors:
                    await updates.load(tensors)
            except OpenTinkerError:
                self._weights_stream, self._by_reference = WeightStream(), 0
                raise
            del tensors  # views of the segment: the trainer may write there once answered
            if not chunk.shared:
                return None  # more chunks of this update to come
            return rollout_pb2.RolloutResponse(
                taken=rollout_pb2.WeightChunkTaken(
                    policy_version=chunk.policy_version, request_seq=seq
                )
            )
        count = self._weights_stream.tensors_received + self._by_reference
        self._weights_stream, self._by_reference = WeightStream(), 0
        tensors |= self.incoming.shared(chunk)
        result = await updates.apply(
            tensors, chunk.policy_version, chunk.probe_token_ids, tensors_in_update=count
        )
        return rollout_pb2.RolloutResponse(
            applied=rollout_pb2.WeightsApplied(
                policy_version=result.policy_version,
                probe_logprobs=result.probe_logprobs,
                apply_seconds=result.apply_seconds,
            )
        )


ACCESS_RULES = rules_for(
    rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
    {"Rollout": JOBS | USERS, "SampleTokens": JOBS | USERS, "ScoreTokens": JOBS | USERS},
)


async def create_server(
    settings: RolloutSettings,
    *,
    engine_factory: EngineFactory | None = None,
    job_id: str = "",
    attempt: int = 0,
    shared: SharedAdapters | None = None,
    authenticator: Authenticator | None = None,
    on_trainer_lost: Callable[[str], None] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A started RolloutService server (health + reflection); returns (server, bound port).

    Private (default): admits only the holder of ``settings.credential`` (the job's trainer).
    ``shared``: serves many LoRA jobs on one engine, each caller checked by ``authenticator``
    (the scheduler's IdentityService: any job token it vouches for). ``on_trainer_lost``: told
    why when a trainer leaves an opened stream unclosed (a private rollout's main exits)."""
    if shared is not None and authenticator is None:
        raise ValueError("a shared rollout needs an authenticator for its jobs' tokens")
    if authenticator is None:
        authenticator = OwnCredentialAuthenticator(
            settings.credential, job_id=job_id, attempt=attempt
        )
    server, port, health_servicer = create_aio_server(
        [SERVICE_NAME],
        host=settings.host,
        port=settings.port,
        interceptors=[AuthInterceptor(authenticator, ACCESS_RULES)],
        keepalive_s=settings.trainer_keepalive_s,
    )
    servicer = RolloutServicer(
        settings,
        engine_factory or default_engine_factory(settings),
        shared=shared,
        on_trainer_lost=on_trainer_lost,
    )
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    await server.start()
    await mark_serving(health_servicer, [SERVICE_NAME])
    log.info("rollout_serving", host=settings.host, port=port, envhub=settings.envhub_address)
    return server, port
