"""The Tinker calls that do work on a training model. Each answers at once with a future's
request id; the work runs in the model's seq order (see ordering.py) on its trainer session,
and its result (or error) waits in the FutureStore for retrieve_future."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

from opentinker.common.v1 import common_pb2
from opentinker.errors import InvalidArgumentError, NotFoundError, OpenTinkerError
from opentinker.services.gateway import wire
from opentinker.services.gateway.futures import Result
from opentinker.services.gateway.models import SAMPLER_KIND, STATE_KIND, TinkerPath, TrainingModel
from opentinker.services.gateway.ordering import SeqGate
from opentinker.services.gateway.runs import (
    RUN_NAME,
    check_saved_state,
    keep_user_metadata,
    set_ttl,
)
from opentinker.services.gateway.stability import with_recorded_logprobs
from opentinker.services.gateway.state import Gateway
from opentinker.services.gateway.tenancy import Caller
from opentinker.session_config import SessionConfig
from opentinker.spec import LoraConfig
from opentinker.training_session import AdamParams, LossName

BASE_SAMPLER_NAME = "tinker-base-sampler"  # its session job's name (not a training run)
UNEMBED_NOT_SERVED = "not trained: the gateway's unembed_lora is off (engines may not serve it)"


async def ordered(model: TrainingModel, seq: int | None, submit: Callable[[], Future]) -> Any:
    """Run ``submit`` (it queues one trainer call) in the model's turn ``seq``, then wait for
    the call's result. The turn passes on even when ``submit`` fails, so later calls go on."""
    if seq is None:
        raise InvalidArgumentError("seq_id: required for a training client's calls")
    await model.gate.wait_turn(seq)
    try:
        future = submit()
    finally:
        await model.gate.advance()
    return await asyncio.wrap_future(future)


async def pass_turn(model: TrainingModel, seq: int | None) -> None:
    """Let a call refused for its input pass its turn ``seq`` (when it has one): the SDK has
    numbered it, and every later call of the model would wait for it and fail."""
    done: Future = Future()
    done.set_result(None)
    with contextlib.suppress(OpenTinkerError):  # no seq, or one used already
        await ordered(model, seq, lambda: done)


async def create_model(gw: Gateway, caller: Caller, body: dict) -> dict:
    gw.sessions.check(body["session_id"], caller.tenant_id)
    model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
    config = body.get("lora_config") or {}
    lora, seed = wire.lora_config(config, unembed=gw.settings.unembed_lora)
    metadata = body.get("user_metadata") or {}
    if config.get("train_unembed", True) and "lm_head" not in lora.target_modules:
        metadata = {**metadata, "opentinker.train_unembed": UNEMBED_NOT_SERVED}

    async def work() -> Result:
        result = await start_model(gw, caller, model_id, body["base_model"], lora, seed=seed)
        if metadata:
            model = await gw.models.get(model_id, caller)
            await asyncio.to_thread(keep_user_metadata, gw, model.job_id, metadata)
        return result

    return {"request_id": gw.futures.start(work(), tenant=caller.tenant_id), "model_id": model_id}


async def base_sampler(gw: Gateway, caller: Caller, session_id: str, base_model: str):
    """A Tinker session's sampler of a bare base model: a rank-1 LoRA session job (its LoRA
    starts at zero, so it samples as the base model) serving its weights on the same rollout
    engine as every other sampler; one per session and base model, closed with the session."""
    gw.sessions.check(session_id, caller.tenant_id)
    model_id = f"{session_id}:base:{base_model}"
    with contextlib.suppress(NotFoundError):
        return await gw.models.get(model_id, caller)
    await start_model(
        gw, caller, model_id, base_model, LoraConfig(rank=1), job_name=BASE_SAMPLER_NAME
    )
    model = await gw.models.get(model_id, caller)
    version = await asyncio.wrap_future(model.session.save_weights_for_sampler_async())
    model.named_versions[""] = version  # the base weights' snapshot
    return model


async def start_model(
    gw: Gateway,
    caller: Caller,
    model_id: str,
    base_model: str,
    lora: LoraConfig,
    first_seq: int = 1,
    job_name: str = RUN_NAME,
    seed: int = 0,
) -> Result:
    """A training model of the caller: a session job training ``lora`` on ``base_model``
    (``seed``: of its LoRA init)."""
    gw.models.starting(model_id)
    try:
        session = await asyncio.to_thread(
            caller.client.training_session,
            base_model=gw.settings.base_models.get(base_model, base_model),
            lora=lora,
            name=job_name,
            session=SessionConfig(seed=seed),
            wait_timeout=gw.settings.session_start_timeout_s,
            timeout=gw.settings.call_timeout_s,
        )
    except BaseException:
        gw.models.failed(model_id)
        raise
    gate = SeqGate(first=first_seq, wait_s=gw.settings.order_wait_s)
    gw.models.add(TrainingModel(model_id, caller.tenant_id, base_model, lora.rank, session, gate))
    return Result({"model_id": model_id, "type": "create_model"})


async def forward_backward(gw: Gateway, caller: Caller, body: bytes) -> dict:
    request = wire.parse_forward_backward(body)
    model = await gw.models.get(request.model_id, caller)

    def submit() -> Future:
        options = wire.loss_options(request.loss_fn, wire.loss_config(request))
        data = wire.session_data(request)
        if request.loss_fn == "stable_reinforce":
            data = with_recorded_logprobs(request, data, model.stability)
        call = (
            model.session.forward_async
            if request.forward_only
            else (model.session.forward_backward_async)
        )
        return call(data, cast(LossName, request.loss_fn), **options)  # loss_options checked it

    async def work() -> Result:
        output = await ordered(model, request.seq_id, submit)
        return Result(wire.forward_backward_output(output))

    return start_future(gw, caller, work(), model)


async def optim_step(gw: Gateway, caller: Caller, body: dict) -> dict:
    model = await gw.models.get(body["model_id"], caller)

    def submit() -> Future:  # params checked in the call's turn: refused, it still passes it
        return model.session.optim_step_async(adam_params(body.get("adam_params")))

    async def work() -> Result:
        out = await ordered(model, body.get("seq_id"), submit)
        return Result({"metrics": {"grad_norm:mean": out.grad_norm, "step:max": float(out.step)}})

    return start_future(gw, caller, work(), model)


def adam_params(params: dict | None) -> AdamParams:
    if params is None:
        raise InvalidArgumentError("optimizer_params: only AdamW (adam_params) is served")
    try:
        return AdamParams(**{k: float(v) for k, v in params.items() if k != "type"})
    except (TypeError, ValueError) as err:  # an unknown or non-numeric setting
        raise InvalidArgumentError(f"adam_params: {params!r} ({err})") from err


async def save_weights(gw: Gateway, caller: Caller, body: dict) -> dict:
    """save_state: weights + optimizer state as ``tinker://<job>/weights/<name>``."""
    model = await gw.models.get(body["model_id"], caller)
    path = TinkerPath(model.job_id, STATE_KIND, body.get("path") or f"step-{model.gate.next}")

    async def work() -> Result:
        await ordered(model, body.get("seq_id"), lambda: model.session.save_state_async(path.name))
        if body.get("ttl_seconds") is not None and gw.settings.checkpoint_root is not None:
            await asyncio.to_thread(set_ttl, gw, caller, path, body["ttl_seconds"])
        return Result({"path": str(path), "type": "save_weights"})

    return start_future(gw, caller, work(), model)


async def load_weights(gw: Gateway, caller: Caller, body: dict) -> dict:
    """Into a model (model_id + seq_id), or into a new one (session_id + model_seq_id: a
    training client created from a saved state, model id ``<session>:train:<n>``)."""
    if body.get("model_id"):
        model = await gw.models.get(body["model_id"], caller)
        work = _load_into(gw, caller, model, body.get("seq_id"), body["path"])
        return start_future(gw, caller, work, model)
    path = await asyncio.to_thread(saved_state_path, gw, caller, body["path"])
    gw.sessions.check(body["session_id"], caller.tenant_id)
    model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
    work = _load_new(gw, caller, model_id, body.get("base_model"), path)
    return {"request_id": gw.futures.start(work, tenant=caller.tenant_id), "model_id": model_id}


def saved_state_path(gw: Gateway, caller: Caller, raw: str) -> TinkerPath:
    """The caller's saved state that ``raw`` names (InvalidArgument / NotFound otherwise)."""
    path = TinkerPath.parse(raw)
    if path.kind != STATE_KIND:
        raise InvalidArgumentError(
            f"path: {raw!r} is not a saved state (tinker://<run>/weights/<name>)"
        )
    check_saved_state(gw, caller, path)
    return path


async def _load_into(
    gw: Gateway, caller: Caller, model: TrainingModel, seq: int | None, raw_path: str
) -> Result:
    try:
        path = await asyncio.to_thread(saved_state_path, gw, caller, raw_path)
    except OpenTinkerError:  # refused, the call still passes its turn
        await pass_turn(model, seq)
        raise
    await ordered(model, seq, lambda: model.session.load_state_async(path.trainer_state))
    return Result({"path": str(path), "model_id": model.model_id, "type": "load_weights"})


async def _load_new(
    gw: Gateway, caller: Caller, model_id: str, base_model: str | None, path: TinkerPath
) -> Result:
    source = await asyncio.to_thread(gw.job_model, caller, path.job_id)
    base = base_model or tinker_name(gw, source.base_model)
    await start_model(gw, caller, model_id, base, lora_of(source))
    model = await gw.models.get(model_id, caller)
    try:
        await asyncio.wrap_future(model.session.load_state_async(path.trainer_state))
    except BaseException:  # no half-made client: end its session, free its device
        gw.models.remove(model)
        await asyncio.to_thread(model.session.close)
        raise
    return Result({"path": str(path), "model_id": model_id, "type": "load_weights"})


async def save_weights_for_sampler(gw: Gateway, caller: Caller, body: dict) -> dict:
    """Serve the current weights to sample, kept as a snapshot (the trainer's policy
    version): named -> a sampler path, else a sampling session; either samples these weights
    for as long as it lives. Named weights are also saved as a state (``sampler.<name>``),
    so the path stays sampleable after the run ends (``sampler_of_saved``)."""
    model = await gw.models.get(body["model_id"], caller)
    name = body.get("path")
    path = TinkerPath(model.job_id, SAMPLER_KIND, name) if name else None
    saved: list[Future] = []

    def submit() -> Future:  # both in this call's turn: the state holds the served weights
        served = model.session.save_weights_for_sampler_async()
        if path is not None:
            saved.append(model.session.save_state_async(path.trainer_name))
        return served

    async def work() -> Result:
        version = await ordered(model, body.get("seq_id"), submit)
        if path is not None:
            await asyncio.wrap_future(saved[0])
            model.sampler_names[path.name] = time.time()
            model.named_versions[path.name] = version
            return Result({"path": str(path), "type": "save_weights_for_sampler"})
        sampler = gw.models.new_sampler(model, version)
        return Result({"sampling_session_id": sampler, "type": "save_weights_for_sampler"})

    return start_future(gw, caller, work(), model)


async def sampler_of_saved(gw: Gateway, caller: Caller, session_id: str, path: TinkerPath):
    """A model serving the caller's saved sampler weights ``path`` whose run has ended (or
    was served by an earlier gateway): a session job of the run's model that loads them, one
    per session and path, closed with the session. NotFoundError for weights that are not
    the caller's, or not there."""
    gw.sessions.check(session_id, caller.tenant_id)
    model_id = f"{session_id}:saved:{path.job_id}/{path.kind}/{path.name}"
    with contextlib.suppress(NotFoundError):
        return await gw.models.get(model_id, caller)
    await asyncio.to_thread(check_saved_state, gw, caller, path)
    source = await asyncio.to_thread(gw.job_model, caller, path.job_id)
    base = tinker_name(gw, source.base_model)
    await start_model(gw, caller, model_id, base, lora_of(source), job_name=BASE_SAMPLER_NAME)
    model = await gw.models.get(model_id, caller)
    try:
        await asyncio.wrap_future(model.session.load_state_async(path.trainer_state))
        version = await asyncio.wrap_future(model.session.save_weights_for_sampler_async())
    except BaseException:  # no half-made sampler: end its session, free its device
        gw.models.remove(model)
        await asyncio.to_thread(model.session.close)
        raise
    model.named_versions[path.name] = version
    return model


async def snapshot_of(
    gw: Gateway, caller: Caller, session_id: str, path: TinkerPath
) -> tuple[TrainingModel, int]:
    """The model and policy version that serve the caller's checkpoint ``path``: the live
    run's snapshot of named sampler weights, else the checkpoint loaded from disk (a run
    that has ended, training weights, or weights an earlier gateway served)."""
    live = gw.models.live_job(path.job_id)
    if (
        path.kind == SAMPLER_KIND
        and live is not None
        and live.tenant_id == caller.tenant_id
        and path.name in live.named_versions
    ):
        return live, live.named_versions[path.name]
    model = await sampler_of_saved(gw, caller, session_id, path)
    return model, model.named_versions[path.name]


def lora_of(model: common_pb2.ModelSpec) -> LoraConfig:
    """The LoRA config a run's job trained (its rank, alpha and target modules)."""
    lora = model.lora
    return LoraConfig(
        rank=lora.rank,
        alpha=lora.alpha or LoraConfig().alpha,
        dropout=lora.dropout,
        target_modules=tuple(lora.target_modules) or LoraConfig().target_modules,
    )


def tinker_name(gw: Gateway, base_model: str) -> str:
    """The Tinker name of a base model a job was given (the first configured name that maps
    to it), so a model made from a saved state is named as its run was."""
    return next(
        (n for n, local in gw.settings.base_models.items() if local == base_model), base_model
    )


def start_future(gw: Gateway, caller: Caller, work: Any, model: TrainingModel) -> dict:
    """Run ``work`` as a future of the caller; the answer the SDK polls with retrieve_future."""
    request_id = gw.futures.start(work, tenant=caller.tenant_id)
    return {"request_id": request_id, "model_id": model.model_id}
