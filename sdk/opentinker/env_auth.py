"""The env token: how an environment server knows that a call comes from its EnvHub.

An env server runs what its episodes do (the model's code, in code envs), so only the EnvHub
it registered with may call its ``EnvironmentService``. The server makes a secret at start-up
(``new_env_token``), sends it to EnvHub in ``RegisterEnvironmentRequest.env_token`` (a call
already authenticated by the user's API key), and EnvHub presents it on every call in the
metadata ``opentinker-env-token: <token>``. ``EnvTokenInterceptor`` refuses, UNAUTHENTICATED,
every ``EnvironmentService`` call without it; health checks and reflection stay open.

Why the server makes the token rather than EnvHub: it knows it before it can be reached (no
moment without a check, no waiting for EnvHub's reply), and an EnvHub that forgets the
registration (expiry, restart) gets the same token again, so nothing is rotated under episodes
in flight. A registrant that names someone else's address gains nothing: EnvHub presents that
server the registrant's own token, which it refuses. protos/opentinker/envhub/v1/
environment.proto ("Authentication") states the same rules for servers in any language.

Tokens never reach a log: the interceptor logs the method and what was wrong, never a value,
and compares in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog

from opentinker.envhub.v1 import environment_pb2

ENV_TOKEN_METADATA_KEY = "opentinker-env-token"
_SERVICE = environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name
_GUARDED_PREFIX = f"/{_SERVICE}/"
_TOKEN = re.compile(r"[\x21-\x7e]{32,256}")  # printable ASCII, no spaces: a metadata value

log = structlog.get_logger("opentinker.env_server")


def new_env_token() -> str:
    """A fresh env token: 32 random bytes, base64url (43 characters)."""
    return secrets.token_urlsafe(32)


def env_token_problem(token: str) -> str | None:
    """What is wrong with ``token`` as an env token (never quoting it), or None."""
    if _TOKEN.fullmatch(token):
        return None
    return (
        f"env_token must be 32 to 256 printable ASCII characters without spaces (got "
        f"{len(token)} characters{'' if token.isascii() else ', not all ASCII'}); make it from "
        "32 random bytes (hex or base64url)"
    )


def env_token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that presents ``token`` to an env server."""
    return ((ENV_TOKEN_METADATA_KEY, token),)


def token_problem(metadata: Sequence[tuple[str, Any]] | None, expected: str) -> str | None:
    """Why a call with ``metadata`` does not present ``expected`` (None when it does). Exactly
    one value must be present; it is compared in constant time."""
    values = [v for k, v in metadata or () if k == ENV_TOKEN_METADATA_KEY]
    if not values:
        return f"no '{ENV_TOKEN_METADATA_KEY}' metadata"
    if len(values) > 1:
        return f"'{ENV_TOKEN_METADATA_KEY}' metadata sent {len(values)} times"
    value = values[0]
    received = value if isinstance(value, bytes) else str(value).encode()
    if not hmac.compare_digest(received, expected.encode()):
        return f"the '{ENV_TOKEN_METADATA_KEY}' metadata is not this server's env token"
    return None


class EnvTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every ``EnvironmentService`` call that does not present the server's token."""

    def __init__(self, token: str, *, env_name: str) -> None:
        problem = env_token_problem(token)
        if problem is not None:
            raise ValueError(problem)
        self._token = token
        self._env_name = env_name

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if not method.startswith(_GUARDED_PREFIX):  # health, reflection
            return continuation(handler_call_details)
        problem = token_problem(handler_call_details.invocation_metadata, self._token)
        if problem is None:
            return continuation(handler_call_details)
        log.warning("env_call_refused", env=self._env_name, method=method, problem=problem)
        message = (
            f"environment server '{self._env_name}' takes calls only from the EnvHub it "
            f"registered with: {problem}. Run episodes through EnvHub (RunEpisodes); for a "
            f"direct call to a server you started, send its env token as '"
            f"{ENV_TOKEN_METADATA_KEY}' metadata (EnvServerHandle.channel() does)"
        )

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return grpc.unary_unary_rpc_method_handler(refuse)


class _EnvTokenClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Adds the env token to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation, client_call_details, request):  # noqa: ANN001, ANN201
        pairs = [
            (k, v) for k, v in (client_call_details.metadata or ()) if k != ENV_TOKEN_METADATA_KEY
        ]
        pairs += env_token_metadata(self._token)
        return continuation(client_call_details._replace(metadata=tuple(pairs)), request)


def with_env_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """``channel`` with ``token`` presented on every (unary) call: for direct calls to an env
    server one started oneself (tests, debugging)."""
    return grpc.intercept_channel(channel, _EnvTokenClientInterceptor(token))
