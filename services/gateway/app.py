"""The Tinker HTTP API (``/api/v1``) in front of the mesh: an ASGI app (Starlette).

Session-level calls (config, sessions, capabilities, sampling sessions, get_info) answer
directly; calls that do work answer with a future (training_routes.py) that
``retrieve_future`` long-polls. Every call but healthz needs ``X-API-Key`` (tenancy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from opentinker.catalog import ModelInfo
from opentinker.errors import InvalidArgumentError, OpenTinkerError
from opentinker.services.gateway import downloads, runs, sampling, wire
from opentinker.services.gateway import training_routes as training
from opentinker.services.gateway.futures import error_body
from opentinker.services.gateway.http_errors import http_status, read_body
from opentinker.services.gateway.models import SAMPLER_KIND, TinkerPath
from opentinker.services.gateway.openai_routes import openai_routes
from opentinker.services.gateway.settings import GatewaySettings
from opentinker.services.gateway.state import Gateway
from opentinker.services.gateway.tenancy import Caller

log = structlog.get_logger("gateway")
PROTOBUF = "application/x-protobuf"
Handler = Callable[[Gateway, Caller, Any], Awaitable[dict | Response | None]]


def create_app(settings: GatewaySettings) -> Starlette:
    gw = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        reaper = asyncio.create_task(_close_expired_sessions(gw))
        yield
        reaper.cancel()
        await asyncio.to_thread(gw.close)  # close the trainer sessions still open

    app = Starlette(routes=_routes(gw), lifespan=lifespan)
    app.state.gateway = gw
    return app


def _routes(gw: Gateway) -> list[Route]:
    """Tinker's HTTP API, path by path."""

    def route(path: str, handler: Handler, *, raw: bool = False, method: str = "POST") -> Route:
        return Route(path, _endpoint(gw, path, handler, raw=raw), methods=[method])

    checkpoint = "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}"
    return [
        *openai_routes(gw),  # /v1: the OpenAI-compatible door
        Route("/api/v1/healthz", _healthz, methods=["GET"]),
        route("/api/v1/client/config", client_config),
        route("/api/v1/client/dynamic_config", lambda gw, c, b: _answer({})),
        route("/api/v1/telemetry", lambda gw, c, b: _answer({"status": "accepted"})),
        route("/api/v1/get_server_capabilities", capabilities, method="GET"),
        route("/api/v1/create_session", create_session),
        route("/api/v1/sessions/{session_id}/finish", finish_session),
        route("/api/v1/session_heartbeat", session_heartbeat),
        route("/api/v1/create_sampling_session", create_sampling_session),
        route("/api/v1/get_info", get_info),
        route("/api/v1/samplers/{sampling_session_id}", get_sampler, method="GET"),
        route("/api/v1/retrieve_future", retrieve_future),
        route("/api/v1/create_model", training.create_model),
        route("/api/v1/forward_backward", training.forward_backward, raw=True),
        route("/api/v1/optim_step", training.optim_step),
        route("/api/v1/save_weights", training.save_weights),
        route("/api/v1/load_weights", training.load_weights),
        route("/api/v1/save_weights_for_sampler", training.save_weights_for_sampler),
        route("/api/v1/asample", sampling.asample),
        route("/api/v1/training_runs", runs.list_training_runs, method="GET"),
        route("/api/v1/training_runs/{training_run_id}", runs.get_training_run, method="GET"),
        route(
            "/api/v1/training_runs/{training_run_id}/checkpoints",
            runs.list_checkpoints,
            method="GET",
        ),
        route("/api/v1/save_weights_external", downloads.save_weights_external),
        route(checkpoint + "/ttl", runs.set_checkpoint_ttl, method="PUT"),
        route(checkpoint + "/external_weights_urls", downloads.external_weights_urls, method="GET"),
        Route("/api/v1/files/{token}", downloads.file_route(gw), methods=["GET"]),  # signed URLs
        route(checkpoint, runs.delete_checkpoint, method="DELETE"),
        route("/api/v1/checkpoints", runs.list_user_checkpoints, method="GET"),
    ]


def _endpoint(gw: Gateway, path: str, handler: Handler, *, raw: bool):
    """``handler`` behind the key check; a call that starts work (its answer names a
    request_id) is answered again, not redone, when retried with the same X-Idempotency-Key."""

    async def endpoint(request: Request) -> Response:
        try:
            caller = await gw.tenancy.caller(request.headers.get("x-api-key"))
            key = request.headers.get("x-idempotency-key")
            if key and (first := gw.answered.get((caller.tenant_id, key))) is not None:
                return JSONResponse(first)  # a retry of a call already taken
            raw_body = await read_body(request, gw.settings.max_body_bytes)
            body: bytes | dict = raw_body
            if not raw:
                body = {**request.query_params, **_json(raw_body), **request.path_params}
                body.setdefault("base_url", str(request.base_url))
            with gw.sessions.active(_session_of(body)):
                answer = await handler(gw, caller, body)
            if answer is None:
                answer = {}
            if key and isinstance(answer, dict) and _starts_work(answer):
                gw.remember(caller.tenant_id, key, answer)
            return answer if isinstance(answer, Response) else JSONResponse(answer)
        except (OpenTinkerError, ValueError, KeyError) as err:
            return _error(err)
        except ClientDisconnect:  # the client went away mid-request: nobody to answer
            log.warning("client_disconnected", path=path)
            return Response(status_code=499)
        except Exception as err:  # a bug of ours: say so, the SDK retries 5xx
            log.exception("call_failed", path=path)
            return JSONResponse(error_body(err), status_code=500)

    return endpoint


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _answer(body: dict) -> dict:
    return body


def _json(raw: bytes) -> dict:
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise InvalidArgumentError(f"body: not JSON ({err})") from err
    except RecursionError as err:  # nested past Python's limit: no call of ours needs that
        raise InvalidArgumentError("body: JSON nested too deeply") from err
    return wire.check_json_body(body)


def _error(err: Exception) -> JSONResponse:
    status = http_status(err)
    if isinstance(err, KeyError):
        err = InvalidArgumentError(f"{err.args[0]}: required")
    return JSONResponse(error_body(err), status_code=status)


async def client_config(gw: Gateway, caller: Caller, body: dict) -> dict:
    """Feature flags for the SDK: API-key auth (no JWT exchange), uncompressed protobuf
    forward_backward, per-request sampling futures."""
    return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False}


async def capabilities(gw: Gateway, caller: Caller, body: dict) -> dict:
    """The configured base names, then the models of the scheduler's catalog (``opentinker
    models list``) not among them; each also says what it maps to (``path``: a local
    directory, a .gguf or a hub id, a field the SDK ignores) and its context length when known
    (a catalog entry's, or the config.json of a configured directory). A catalog model is
    trainable when the pool runs LoRA on it (Tinker trains LoRA adapters)."""
    configured = [
        {
            "model_name": name,
            "path": local,
            "trainable": True,
            "sampleable": True,
            "max_context_length": _context_length(local),
        }
        for name, local in gw.settings.base_models.items()
    ]
    catalog = await asyncio.to_thread(caller.client.models, timeout=10)
    listed = [
        {
            "model_name": model.name,
            "path": model.location or model.name,
            "trainable": not model.finetunes or "lora" in model.finetunes,
            "sampleable": True,
            "max_context_length": model.context_length or None,
        }
        for model in catalog
        if model.name not in gw.settings.base_models
    ]
    return {"supported_models": configured + listed}


def tokenizer_location(base_model: str, catalog: Sequence[ModelInfo]) -> str:
    """Where the SDK loads ``base_model``'s tokenizer from: a catalog entry's location (a
    local folder), else the name as given (a hub id). The SDK's ``get_tokenizer()`` looked a
    catalog name up on the hub, which has no ``tiny-qwen2``."""
    for entry in catalog:
        if entry.name == base_model and entry.location:
            return entry.location
    return base_model


def _context_length(local: str) -> int | None:
    try:
        config = json.loads((Path(local) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    length = config.get("max_position_embeddings")
    return int(length) if isinstance(length, int) else None


async def create_session(gw: Gateway, caller: Caller, body: dict) -> dict:
    return {"type": "create_session", "session_id": gw.sessions.create(caller.tenant_id)}


async def session_heartbeat(gw: Gateway, caller: Caller, body: dict) -> dict:
    gw.sessions.beat(body["session_id"], caller.tenant_id)
    return {"type": "session_heartbeat"}


async def finish_session(gw: Gateway, caller: Caller, body: dict) -> dict:
    """The SDK's ServiceClient.close(): close the session's training models (their jobs
    succeed, reason "closed", and free their devices)."""
    gw.sessions.finish(body["session_id"], caller.tenant_id)
    await _close_session(gw, body["session_id"], caller.tenant_id)
    return {}


async def _close_session(gw: Gateway, session_id: str, tenant_id: str | None) -> None:
    """Close the session's models (of ``tenant_id``; None: whoever's). One that cannot be
    closed (its trainer is gone: job cancelled, worker lost) does not keep the others open."""
    prefix = f"{session_id}:"
    for model in gw.models.all():
        if model.model_id.startswith(prefix) and tenant_id in (None, model.tenant_id):
            gw.models.remove(model)
            try:
                await asyncio.to_thread(model.session.close)
            except OpenTinkerError as err:
                log.warning("model_close_failed", model_id=model.model_id, error=str(err))


async def _close_expired_sessions(gw: Gateway) -> None:
    """Every few seconds: close the models of sessions whose client went silent, and delete
    the checkpoints whose TTL has passed."""
    while True:
        await asyncio.sleep(min(5.0, gw.settings.session_expiry_s / 4))
        if gw.settings.checkpoint_root is not None:
            for folder in await asyncio.to_thread(runs.delete_expired, gw.settings.checkpoint_root):
                log.info("checkpoint_expired", folder=str(folder))
        for session_id in gw.sessions.expired():
            log.info("session_expired", session_id=session_id)
            try:
                await _close_session(gw, session_id, None)
            except Exception:  # one failed close must not stop the reaper
                log.exception("session_close_failed", session_id=session_id)


async def create_sampling_session(gw: Gateway, caller: Caller, body: dict) -> dict:
    """A sampling client of saved sampler weights (tinker://<job>/sampler_weights/<name>), or
    of a bare base model (training.base_sampler)."""
    if not body.get("model_path"):
        if not body.get("base_model"):
            raise InvalidArgumentError("base_model: required to sample without a model_path")
        model = await training.base_sampler(gw, caller, body["session_id"], body["base_model"])
        sampler = gw.models.new_sampler(model, model.named_versions[""])
        return {"type": "create_sampling_session", "sampling_session_id": sampler}
    path = TinkerPath.parse(body["model_path"])
    if path.kind != SAMPLER_KIND:
        raise InvalidArgumentError(f"model_path: {body['model_path']!r} is not sampler weights")
    model, version = await training.snapshot_of(gw, caller, body["session_id"], path)
    sampler = gw.models.new_sampler(model, version)
    return {"type": "create_sampling_session", "sampling_session_id": sampler}


async def get_sampler(gw: Gateway, caller: Caller, body: dict) -> dict:
    sampler = body["sampling_session_id"]
    model, _ = gw.models.sampler(sampler, caller)
    return {"sampler_id": sampler, "base_model": model.base_model}


async def get_info(gw: Gateway, caller: Caller, body: dict) -> dict:
    model = await gw.models.get(body["model_id"], caller)
    local = gw.settings.base_models.get(model.base_model)
    if local is None:  # a catalog name: the SDK's get_tokenizer() loads from its location
        catalog = await asyncio.to_thread(caller.client.models, timeout=10)
        local = tokenizer_location(model.base_model, catalog)
    return {
        "type": "get_info",
        "model_id": model.model_id,
        "model_data": {"model_name": model.base_model, "tokenizer_id": local},
        "is_lora": True,
        "lora_rank": model.lora_rank,
        "model_name": model.base_model,
    }


async def retrieve_future(gw: Gateway, caller: Caller, body: dict) -> Response | dict:
    result = await gw.futures.retrieve(body["request_id"], tenant=caller.tenant_id)
    if result is None:
        return {"type": "try_again", "request_id": body["request_id"], "queue_state": "active"}
    if isinstance(result.body, bytes):
        return Response(result.body, media_type=PROTOBUF)
    return result.body


def _session_of(body: Any) -> str | None:
    """The session a call names (directly, or through one of its models)."""
    if not isinstance(body, dict):
        return None
    name = body.get("session_id") or body.get("model_id")
    return name if isinstance(name, str) else None


def _starts_work(answer: dict) -> bool:
    """The answer of a call that started a future (not a poll's try_again)."""
    return "request_id" in answer and answer.get("type") != "try_again"
