"""The blocking gRPC connection that the SDK's clients share: channel, key, deadlines, errors."""

from __future__ import annotations

from typing import Any

import grpc

from opentinker.auth import api_key_from_env, with_credential
from opentinker.errors import from_rpc_error

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class Connection:
    """A channel to ``address`` whose every call carries ``api_key`` (default
    ``$OPENTINKER_API_KEY``) and a deadline, and raises typed ``opentinker.errors``."""

    def __init__(self, address: str, *, api_key: str | None, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self.channel = with_credential(
            grpc.insecure_channel(address, options=CHANNEL_OPTIONS), api_key_from_env(api_key)
        )

    def call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """``method(request)`` with ``timeout`` (None = the connection's), errors typed."""
        try:
            return method(request, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def close(self) -> None:
        self.channel.close()
