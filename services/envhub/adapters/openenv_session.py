"""One episode on an OpenEnv server: its WebSocket session API (``/ws``), and its ``/schema``.

OpenEnv's HTTP ``/reset`` and ``/step`` are stateless (a fresh env per call), so every episode
holds one WebSocket: the server gives each connection its own environment instance. Messages
are ``{"type": "reset"|"step"|"close", "data": {...}}``; replies are ``{"type":
"observation", "data": {"observation": {...}, "reward": float|null, "done": bool}}`` or
``{"type": "error", "data": {"message": ..., "code": ...}}``.

Errors, as our typed errors (hence gRPC status codes):
- unreachable server, dropped connection, reply timeout: ``UnavailableError`` (UNAVAILABLE);
- a reply larger than ``MAX_REPLY_BYTES``: ``EnvironmentError_`` (INTERNAL) naming the limit
  (the connection is dropped before the reply is read whole, so it cannot exhaust memory);
- ``CAPACITY_REACHED``: ``ResourceExhaustedError``;
- ``VALIDATION_ERROR`` (the action or reset options did not validate):
  ``InvalidArgumentError``;
- any other error code, or a reply that is not what the protocol says: ``EnvironmentError_``
  (INTERNAL) naming the server and what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.frames import CloseCode
from websockets.sync.client import ClientConnection, connect

from opentinker.errors import (
    EnvironmentError_,
    InvalidArgumentError,
    OpenTinkerError,
    ResourceExhaustedError,
    UnavailableError,
)

MAX_REPLY_BYTES = 16 * 1024 * 1024  # far above any observation the rollout accepts (16 K chars)

_ERROR_TYPES: dict[str, type[OpenTinkerError]] = {
    "CAPACITY_REACHED": ResourceExhaustedError,
    "VALIDATION_ERROR": InvalidArgumentError,
}


@dataclass(frozen=True)
class OpenEnvReply:
    """One observation reply: the observation's own fields (reward/done/metadata excluded by
    the server), the reward (None = the env gave none) and whether the episode ended."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


def ws_url_of(base_url: str) -> str:
    """``http://h:p[/prefix]`` -> ``ws://h:p[/prefix]/ws`` (https -> wss)."""
    base = base_url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if base.startswith(http):
            return ws + base[len(http) :] + "/ws"
    if base.startswith(("ws://", "wss://")):
        return base if base.endswith("/ws") else base + "/ws"
    raise InvalidArgumentError(
        f"OpenEnv url {base_url!r} must start with http://, https://, ws:// or wss://",
        reason="BAD_URL",
    )


def fetch_schema(base_url: str, *, timeout_s: float) -> dict[str, Any]:
    """The server's ``GET /schema``: ``{"action": {...}, "observation": {...}, ...}``."""
    url = base_url.rstrip("/") + "/schema"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - our url
            body = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise UnavailableError(
            f"OpenEnv server {base_url} is unreachable ({url}): {exc}",
            reason="OPENENV_UNREACHABLE",
        ) from exc
    try:
        schema = json.loads(body)
    except ValueError as exc:
        raise _bad_reply(base_url, f"/schema is not JSON ({exc})") from exc
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise _bad_reply(base_url, "/schema has no 'action' JSON schema object")
    return schema


class OpenEnvSession:
    """One WebSocket session (one env instance on the server) for one episode."""

    def __init__(self, base_url: str, *, timeout_s: float) -> None:
        self.base_url = base_url
        self._timeout_s = timeout_s
        self._ws: ClientConnection | None = None

    def reset(self, options: dict[str, Any]) -> OpenEnvReply:
        """Open the session (once) and reset its env with ``options`` (seed included)."""
        if self._ws is None:
            self._ws = self._connect()
        return self._observation(self._exchange({"type": "reset", "data": options}))

    def step(self, action: dict[str, Any]) -> OpenEnvReply:
        return self._observation(self._exchange({"type": "step", "data": action}))

    def close(self) -> None:
        """Tell the server the episode is over, then drop the connection; never raises."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        with contextlib.suppress(ConnectionClosed, OSError):
            ws.send(json.dumps({"type": "close", "data": {}}))
        ws.close()

    def _connect(self) -> ClientConnection:
        url = ws_url_of(self.base_url)
        try:
            return connect(url, open_timeout=self._timeout_s, max_size=MAX_REPLY_BYTES)
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
            raise UnavailableError(
                f"OpenEnv server {self.base_url} is unreachable ({url}): {exc}",
                reason="OPENENV_UNREACHABLE",
            ) from exc

    def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message, return the reply's ``data``; error replies raise typed errors."""
        if self._ws is None:
            raise EnvironmentError_("OpenEnv session used before reset", reason="NOT_RESET")
        try:
            try:
                self._ws.send(json.dumps(message))
            except ConnectionClosed:  # it may have said why first (a capacity refusal)
                raw = self._ws.recv(timeout=0)
                return self._data_of(raw, what=message["type"])
            raw = self._ws.recv(timeout=self._timeout_s)
        except TimeoutError as exc:
            raise UnavailableError(
                f"OpenEnv server {self.base_url} did not answer {message['type']} within "
                f"{self._timeout_s:g} s",
                reason="OPENENV_TIMEOUT",
            ) from exc
        except (ConnectionClosed, OSError) as exc:
            if _too_big(exc):
                raise _bad_reply(
                    self.base_url,
                    f"its {message['type']} reply is larger than {MAX_REPLY_BYTES} bytes",
                ) from exc
            raise UnavailableError(
                f"OpenEnv server {self.base_url} dropped the session during "
                f"{message['type']}: {exc}",
                reason="OPENENV_DISCONNECTED",
            ) from exc
        return self._data_of(raw, what=message["type"])

    def _data_of(self, raw: str | bytes, *, what: str) -> dict[str, Any]:
        try:
            reply = json.loads(raw)
        except ValueError as exc:
            raise _bad_reply(self.base_url, f"its {what} reply is not JSON ({exc})") from exc
        if not isinstance(reply, dict) or not isinstance(reply.get("data"), dict):
            raise _bad_reply(self.base_url, f"its {what} reply has no 'data' object: {raw!r:.200}")
        if reply.get("type") == "error":
            data = reply["data"]
            code = str(data.get("code", "")) or "UNKNOWN"
            detail = data.get("errors") or ""
            error_type = _ERROR_TYPES.get(code, EnvironmentError_)
            if code == "CAPACITY_REACHED":  # name the setting to change
                detail = capacity_advice(data.get("max_sessions"))
            raise error_type(
                f"OpenEnv server {self.base_url} refused {what} ({code}): "
                f"{data.get('message', '')} {detail}".strip(),
                reason=f"OPENENV_{code}",
            )
        if reply.get("type") != "observation":
            raise _bad_reply(
                self.base_url, f"its {what} reply has type {reply.get('type')!r}, not observation"
            )
        return reply["data"]

    def _observation(self, data: dict[str, Any]) -> OpenEnvReply:
        observation, reward, done = data.get("observation"), data.get("reward"), data.get("done")
        if not isinstance(observation, dict):
            raise _bad_reply(self.base_url, "its reply's 'observation' is not an object")
        if reward is not None and (
            isinstance(reward, bool)
            or not isinstance(reward, (int, float))
            or not math.isfinite(reward)
        ):
            raise _bad_reply(self.base_url, f"its reward is {reward!r}, not a finite number")
        if not isinstance(done, bool):
            raise _bad_reply(self.base_url, f"its 'done' is {done!r}, not true/false")
        return OpenEnvReply(
            observation=observation, reward=None if reward is None else float(reward), done=done
        )


def capacity_advice(max_sessions: object) -> str:
    """What to change when an OpenEnv server refuses a session for capacity."""
    most = max_sessions if isinstance(max_sessions, int) else "its max_concurrent_envs"
    return (
        f"— the server holds at most {most} sessions, fewer than the adapter offers EnvHub: "
        f"start `opentinker serve openenv-adapter` with --capacity {most} (or leave "
        "--capacity out to discover it), or raise the server's max_concurrent_envs"
    )


def discover_capacity(base_url: str, *, upto: int, timeout_s: float) -> int:
    """How many sessions the server holds at once (its max_concurrent_envs, as long as no one
    else uses it), found by opening sessions one by one until it refuses one or ``upto`` are
    open; all are closed again. ``upto`` when it never refuses."""
    sessions: list[OpenEnvSession] = []
    try:
        while len(sessions) < upto:
            session = OpenEnvSession(base_url, timeout_s=timeout_s)
            try:
                session.reset({})
            except ResourceExhaustedError:
                session.close()
                return max(len(sessions), 1)
            sessions.append(session)
        return upto
    finally:
        for session in sessions:
            session.close()


def _too_big(exc: BaseException) -> bool:
    """We closed the connection because a reply went over ``max_size``."""
    sent = getattr(exc, "sent", None)
    return sent is not None and sent.code == CloseCode.MESSAGE_TOO_BIG


def _bad_reply(base_url: str, problem: str) -> EnvironmentError_:
    return EnvironmentError_(
        f"OpenEnv server {base_url} replied badly: {problem}", reason="OPENENV_BAD_REPLY"
    )
