"""The OpenAI-compatible door (``/v1``): chat and text completions, and the model list, for
any base model or checkpoint of the caller's tenant (``model``: a base model name, or a
``tinker://<run>/sampler_weights/<name>`` or ``tinker://<run>/weights/<name>`` path).

Callers authenticate with the same API keys as everywhere (``Authorization: Bearer <key>``,
with or without Tinker's ``tml-``). A model is served by the same sampler snapshot and the
same sampling path as a Tinker sampling client (sampling.py), in a gateway session of the
tenant's own that closes its samplers when the tenant's calls stop for session_expiry_s.
Errors come in OpenAI's shape, ``param`` naming the field. ``stream: true`` sends the
finished completion as server-sent events (the sampler answers whole sequences).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from opentinker.errors import (
    AuthenticationError,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
)
from opentinker.services.gateway import runs
from opentinker.services.gateway import training_routes as training
from opentinker.services.gateway.http_errors import http_status, read_body
from opentinker.services.gateway.models import TinkerPath, TrainingModel
from opentinker.services.gateway.openai_requests import (
    DEFAULT_CHAT_TOKENS,
    DEFAULT_COMPLETION_TOKENS,
    CompletionRequest,
    OpenAIChatRequest,
    SamplingFields,
    chat_logprobs,
    cut_at_stop,
    text_logprobs,
)
from opentinker.services.gateway.sampling import base_path, sample, sample_call
from opentinker.services.gateway.sessions import SessionGoneError
from opentinker.services.gateway.state import Gateway
from opentinker.services.gateway.tenancy import Caller
from opentinker.services.rollout.agent_endpoint.openai_wire import (
    chat_body,
    chat_choice,
    error_body,
    finish_reason,
    reply_message,
    stream_events,
)
from opentinker.services.rollout.agent_endpoint.segments import render, template_message
from opentinker.spec import validation_message
from opentinker.training_session import SampledSequence

log = structlog.get_logger("gateway.openai")
Reply = tuple[dict[str, Any], bool]  # the body, and whether to stream it
Handler = Callable[[Gateway, Caller, bytes], Awaitable[Reply]]
_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_Request = TypeVar("_Request", bound=BaseModel)
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def openai_routes(gw: Gateway) -> list[Route]:
    return [
        Route("/v1/chat/completions", _endpoint(gw, chat_completions), methods=["POST"]),
        Route("/v1/completions", _endpoint(gw, completions), methods=["POST"]),
        Route("/v1/models", _endpoint(gw, list_models), methods=["GET"]),
    ]


def _endpoint(gw: Gateway, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            caller = await gw.tenancy.caller(_bearer(request))
            body, stream = await handler(gw, caller, await read_body(request, _limit(gw)))
        except (OpenTinkerError, ValueError) as err:
            return _error(http_status(err), str(err))
        except ClientDisconnect:
            log.warning("client_disconnected", path=request.url.path)
            return Response(status_code=499)
        except Exception:  # a bug of ours
            log.exception("call_failed", path=request.url.path)
            return _error(500, "the gateway failed on this call; the log says why")
        if stream:
            return StreamingResponse(stream_events(body), media_type="text/event-stream")
        return JSONResponse(body)

    return endpoint


def _limit(gw: Gateway) -> int:
    return gw.settings.max_body_bytes


def _bearer(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _no_key()
    return key.strip()


def _no_key() -> OpenTinkerError:
    return AuthenticationError(
        "Authorization: missing; send your OpenTinker API key as 'Authorization: Bearer <key>' "
        "(OPENAI_API_KEY)"
    )


def _error(status: int, message: str) -> JSONResponse:
    field = _FIELD.match(message)
    param = field.group(1) if field else None
    kind = _KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = {401: "invalid_api_key", 404: "model_not_found" if param == "model" else "not_found"}
    body = error_body(message, kind, code.get(status, kind), param)
    return JSONResponse(body, status_code=status)


def _parse(kind: type[_Request], raw: bytes) -> _Request:
    try:
        return kind.model_validate_json(raw or b"{}")
    except ValidationError as err:
        raise InvalidArgumentError(validation_message(err)) from err


async def chat_completions(gw: Gateway, caller: Caller, raw: bytes) -> Reply:
    request = _parse(OpenAIChatRequest, raw)
    if request.top_logprobs and not request.logprobs:
        raise InvalidArgumentError("top_logprobs: needs logprobs: true")
    with _session(gw, caller) as session_id:
        model, version = await _sampler(gw, caller, session_id, request.model)
        tokenizer = await _tokenizer(gw, model)
        try:
            prompt = render(
                tokenizer, [template_message(m) for m in request.messages], True, request.tools
            )
        except (ValueError, TypeError) as err:  # no chat template, or messages it cannot take
            raise InvalidArgumentError(f"messages: the chat template refused them ({err})") from err
        sequences = await _sample(
            gw,
            model,
            version,
            prompt,
            request,
            request.token_cap,
            DEFAULT_CHAT_TOKENS,
            request.top_logprobs,
        )
    choices = []
    for index, seq in enumerate(sequences):
        text = cut_at_stop(tokenizer.decode(seq.tokens, skip_special_tokens=True), request.stop)
        message = reply_message(text, request.tool_names)
        logprobs = None
        if request.logprobs:
            top = seq.top_logprobs if request.top_logprobs else None
            logprobs = chat_logprobs(seq.tokens, seq.logprobs, top, _token_text(tokenizer))
        finish = finish_reason(message, seq.stop_reason == "stop")
        choices.append(chat_choice(index, message, finish, logprobs))
    used = sum(len(s.tokens) for s in sequences)
    return chat_body(request.model, choices, len(prompt), used), request.stream


async def completions(gw: Gateway, caller: Caller, raw: bytes) -> Reply:
    request = _parse(CompletionRequest, raw)
    if request.echo:
        raise InvalidArgumentError("echo: not served here (the reply holds the completion only)")
    with _session(gw, caller) as session_id:
        model, version = await _sampler(gw, caller, session_id, request.model)
        tokenizer = await _tokenizer(gw, model)
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = list(tokenizer.encode(prompt))
        sequences = await _sample(
            gw,
            model,
            version,
            prompt,
            request,
            request.max_tokens,
            DEFAULT_COMPLETION_TOKENS,
            request.logprobs,
        )
    choices = []
    for index, seq in enumerate(sequences):
        text = cut_at_stop(tokenizer.decode(seq.tokens, skip_special_tokens=True), request.stop)
        logprobs = None
        if request.logprobs is not None:
            top = seq.top_logprobs if request.logprobs else None
            logprobs = text_logprobs(seq.tokens, seq.logprobs, top, _token_text(tokenizer))
        finish = "stop" if seq.stop_reason == "stop" else "length"
        choices.append(
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        )
    used = sum(len(s.tokens) for s in sequences)
    body = chat_body(request.model, choices, len(prompt), used, kind="text_completion")
    return body, request.stream


async def list_models(gw: Gateway, caller: Caller, raw: bytes) -> Reply:
    """The base models (configured, then the catalog's) and the caller's checkpoints."""
    names = list(gw.settings.base_models)
    catalog = await asyncio.to_thread(caller.client.models, timeout=10)
    names += [m.name for m in catalog if m.name not in gw.settings.base_models]
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "opentinker"} for n in names]
    if gw.settings.checkpoint_root is not None:
        mine = await runs.list_user_checkpoints(gw, caller, {"limit": 1000})
        data += [
            {"id": c["tinker_path"], "object": "model", "created": 0, "owned_by": caller.tenant_id}
            for c in mine["checkpoints"]
        ]
    return {"object": "list", "data": data}, False


async def _sample(
    gw: Gateway,
    model: TrainingModel,
    version: int,
    prompt: list[int],
    request: SamplingFields,
    max_tokens: int | None,
    default_tokens: int,
    top: int | None,
) -> list[SampledSequence]:
    """The sampling path of Tinker's asample, with the request's fields as its params
    (an error names the OpenAI field)."""
    params = request.tinker_params(max_tokens or default_tokens)
    try:
        call = sample_call(prompt, params, num_samples=request.n, topk_sample=top or 0)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(str(err).replace("sampling_params.", "")) from err
    output = await sample(gw, model, version, call)
    return output.sequences


@contextlib.contextmanager
def _session(gw: Gateway, caller: Caller) -> Iterator[str]:
    """The caller's OpenAI-door session (made when it has none live), kept alive while the
    call runs."""
    session_id = gw.openai_sessions.get(caller.tenant_id)
    try:
        if session_id is None:
            raise SessionGoneError("none yet")
        gw.sessions.beat(session_id, caller.tenant_id)
    except SessionGoneError:
        session_id = gw.sessions.create(caller.tenant_id)
        gw.openai_sessions[caller.tenant_id] = session_id
    with gw.sessions.active(session_id):
        yield session_id


async def _sampler(
    gw: Gateway, caller: Caller, session_id: str, name: str
) -> tuple[TrainingModel, int]:
    """The snapshot that serves ``model`` ``name`` to the caller (one start per name even
    when calls for it come at once); errors name the ``model`` field."""
    if not name:
        raise InvalidArgumentError(
            "model: required: a base model (GET /v1/models lists them) or a checkpoint path "
            "tinker://<run>/sampler_weights/<name>"
        )
    lock = gw.openai_locks.setdefault((caller.tenant_id, name), asyncio.Lock())
    async with lock:
        try:
            if name.startswith("tinker://"):
                path = TinkerPath.parse(name)
                return await training.snapshot_of(gw, caller, session_id, path)
            await _check_base(gw, caller, name)
            model = await training.base_sampler(gw, caller, session_id, name)
            return model, model.named_versions[""]
        except (InvalidArgumentError, NotFoundError) as err:
            raise type(err)(f"model: {name!r}: {err}") from err


async def _check_base(gw: Gateway, caller: Caller, name: str) -> None:
    if name in gw.settings.base_models:
        return
    catalog = await asyncio.to_thread(caller.client.models, timeout=10)
    if name not in {m.name for m in catalog}:
        raise NotFoundError(
            "no such base model here and not a tinker:// checkpoint path (GET /v1/models "
            "lists what you can use)"
        )


async def _tokenizer(gw: Gateway, model: TrainingModel) -> Any:
    return await gw.tokenizers.tokenizer(
        base_path(gw, model), need="model: text in and out", instead="send token ids"
    )


def _token_text(tokenizer: Any) -> Callable[[int], str]:
    return lambda token: tokenizer.decode([token])
