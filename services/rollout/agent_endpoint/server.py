"""The HTTP side: one Starlette app for every live episode of a rollout, served by uvicorn in
the rollout's own event loop (the calls then reach the episodes without crossing threads).

An episode's base URL is ``http://HOST:PORT/episodes/<episode_id>/v1`` (HOST: the advertised
host of settings.py, the bind address by default) and its API key a secret made for it alone;
a call with another key is refused (401) before anything runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog
import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from opentinker.grpc_options import host_port
from opentinker.services.rollout.agent_endpoint.openai_wire import (
    ChatRequest,
    error_body,
    stream_events,
)
from opentinker.services.rollout.agent_endpoint.settings import EndpointSettings
from opentinker.spec import validation_message

log = structlog.get_logger("opentinker.rollout.agent_endpoint")

# What an episode does with one validated call: the completion's JSON body.
Complete = Callable[[ChatRequest], Awaitable[dict[str, Any]]]


class CallRefusedError(Exception):
    """A call the episode cannot serve (its budget is spent): HTTP 400 with this message."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _Live:
    token: str
    model: str
    complete: Complete


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the rollout process owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class EndpointServer:
    """Serves the live episodes; ``open`` / ``close`` one per episode."""

    def __init__(self, settings: EndpointSettings | None = None) -> None:
        self.settings = settings or EndpointSettings.load()
        self.host = self.settings.host
        self.port = 0
        self._live: dict[str, _Live] = {}
        self._server: _QuietServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind a free port and serve (idempotent)."""
        if self._task is not None:
            return
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so; without it
        # every response (headers, then body) waited out a delayed ACK, ~40 ms a call.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=5
        )
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises uvicorn's error
                raise RuntimeError("the agent endpoint stopped while starting")
            await asyncio.sleep(0.01)
        log.info(
            "agent_endpoint_serving",
            address=host_port(self.host, self.port),
            advertised=host_port(self.settings.url_host, self.port),
        )

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = None

    def open(self, episode_id: str, model: str, complete: Complete) -> tuple[str, str]:
        """Serve an episode; returns its (base_url, api_key)."""
        token = secrets.token_urlsafe(24)
        self._live[episode_id] = _Live(token, model, complete)
        url_host = host_port(self.settings.url_host, self.port)
        return f"http://{url_host}/episodes/{episode_id}/v1", token

    def close(self, episode_id: str) -> None:
        """Stop serving an episode: its later calls get 404."""
        self._live.pop(episode_id, None)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/episodes/{episode_id}/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/episodes/{episode_id}/v1/models", self._models, methods=["GET"]),
            ]
        )

    def _episode(self, request: Request) -> _Live | JSONResponse:
        episode_id = request.path_params["episode_id"]
        live = self._live.get(episode_id)
        if live is None:
            return _error(
                404,
                f"episode {episode_id!r} is not live on this rollout: it has ended, or the URL "
                "is not the base_url the episode was given",
                "not_found_error",
                "episode_not_found",
            )
        auth = request.headers.get("authorization", "")
        given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not secrets.compare_digest(given.encode(), live.token.encode()):
            return _error(
                401,
                f"wrong or missing API key for episode {episode_id!r}: send the api_key this "
                "episode was given (Authorization: Bearer <key>; OPENAI_API_KEY)",
                "invalid_request_error",
                "invalid_api_key",
            )
        return live

    async def _models(self, request: Request) -> Response:
        live = self._episode(request)
        if isinstance(live, JSONResponse):
            return live
        model = {"id": live.model, "object": "model", "created": 0, "owned_by": "opentinker"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _chat(self, request: Request) -> Response:
        live = self._episode(request)
        if isinstance(live, JSONResponse):
            return live
        try:
            call = ChatRequest.model_validate_json(await request.body())
        except ValidationError as err:
            return _error(
                400,
                f"invalid request: {validation_message(err)}",
                "invalid_request_error",
                "invalid_request",
            )
        try:
            body = await live.complete(call)
        except CallRefusedError as err:
            return _error(400, str(err), "invalid_request_error", err.code)
        if call.stream:
            return StreamingResponse(stream_events(body), media_type="text/event-stream")
        return JSONResponse(body)


def _error(status: int, message: str, kind: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code), status_code=status)
