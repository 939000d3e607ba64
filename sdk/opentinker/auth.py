"""Credentials on the wire: every call to an OpenTinker service carries one in its metadata.

    authorization: Bearer <credential>

A credential is an API key of a user (``otk_<prefix>_<secret>``), a job token (``otj_…``) or
a worker token (``otw_…``); see protos/opentinker/scheduler/v1/identity.proto. This module
adds the header to channels (blocking and asyncio) and keeps credentials out of text meant for
people (``redact``). It needs only grpc.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import grpc

METADATA_KEY = "authorization"
SCHEME = "Bearer "
API_KEY_ENV = "OPENTINKER_API_KEY"

# Kind letter of each credential: user API key, job token, worker token.
KIND_LETTERS = {"k": "user", "j": "job", "w": "worker"}
_CREDENTIAL = re.compile(r"\bot([kjw])_([0-9a-f]{12})_([A-Za-z0-9_-]{20,})")


def api_key_from_env(api_key: str | None = None) -> str:
    """``api_key`` if given, else ``$OPENTINKER_API_KEY``, else ``""``."""
    return api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")


def parse_credential(credential: str) -> tuple[str, str] | None:
    """(kind, prefix) of a well-formed credential, e.g. ("user", "3f2a…"); None otherwise."""
    match = _CREDENTIAL.fullmatch(credential.strip())
    if match is None:
        return None
    return KIND_LETTERS[match.group(1)], match.group(2)


def redact(text: str) -> str:
    """``text`` with the secret part of every credential in it replaced by ``…``."""
    return _CREDENTIAL.sub(lambda m: f"ot{m.group(1)}_{m.group(2)}_…", text)


def metadata(credential: str) -> tuple[tuple[str, str], ...]:
    """The metadata pair(s) carrying ``credential`` (none when it is empty), stripped: a key
    read from a file keeps its newline, which gRPC refuses in metadata (INTERNAL)."""
    credential = credential.strip()
    return ((METADATA_KEY, SCHEME + credential),) if credential else ()


def credential_from_metadata(pairs: Sequence[tuple[str, Any]] | None) -> str:
    """The bearer credential in invocation metadata, or ``""``."""
    for key, value in pairs or ():
        if key == METADATA_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, credential = text.strip().partition(" ")
            return credential.strip() if scheme.lower() == "bearer" else ""  # RFC 7235
    return ""


def _with_credential(details: Any, credential: str, *, aio: bool = False) -> Any:
    # A call's own header is replaced, never doubled.
    pairs = [(k, v) for k, v in (details.metadata or ()) if k != METADATA_KEY]
    pairs += metadata(credential)
    return details._replace(metadata=grpc.aio.Metadata(*pairs) if aio else tuple(pairs))


class _BearerInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the credential to every call of a blocking channel."""

    def __init__(self, credential: str) -> None:
        self._credential = credential

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(_with_credential(client_call_details, self._credential), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(_with_credential(client_call_details, self._credential), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        details = _with_credential(client_call_details, self._credential)
        return continuation(details, request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        details = _with_credential(client_call_details, self._credential)
        return continuation(details, request_iterator)


def with_credential(channel: grpc.Channel, credential: str) -> grpc.Channel:
    """A blocking channel that sends ``credential`` on every call (``channel`` if empty)."""
    if not credential:
        return channel
    return grpc.intercept_channel(channel, _BearerInterceptor(credential))


class _AioBearer:
    """Base of the asyncio interceptors; grpc.aio files each interceptor under one call type
    only, so each type gets its own small class."""

    def __init__(self, credential: str) -> None:
        self._credential = credential

    def _details(self, client_call_details: Any) -> Any:
        return _with_credential(client_call_details, self._credential, aio=True)


class _AioUnaryUnary(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioUnaryStream(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioStreamUnary(_AioBearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _AioStreamStream(_AioBearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def aio_interceptors(credential: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio.*_channel(..., interceptors=...)`` sending ``credential``."""
    if not credential:
        return []
    return [
        _AioUnaryUnary(credential),
        _AioUnaryStream(credential),
        _AioStreamUnary(credential),
        _AioStreamStream(credential),
    ]
