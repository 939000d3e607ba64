"""The blocking gRPC connection that the SDK's clients share: channel, key, deadlines, errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from opentinker.auth import api_key_from_env, with_credential
from opentinker.errors import from_rpc_error
from opentinker.grpc_options import channel_options
from opentinker.tls import ca_file_from_env, open_channel

CHANNEL_OPTIONS = channel_options()  # a server that vanished is noticed in ~15 s


class Connection:
    """A channel to ``address`` whose every call carries ``api_key`` (default
    ``$OPENTINKER_API_KEY``) and a deadline, and raises typed ``opentinker.errors``."""

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None,
        timeout: float,
        ca_file: str | Path | None = None,
    ) -> None:
        """``ca_file``: PEM of the CA that signed the scheduler's certificate (default
        ``$OPENTINKER_TLS_CA_FILE``); none = plaintext."""
        self.address = address
        self.timeout = timeout
        channel = open_channel(address, ca_file=ca_file_from_env(ca_file), options=CHANNEL_OPTIONS)
        self.channel = with_credential(channel, api_key_from_env(api_key))

    def call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """``method(request)`` with ``timeout`` (None = the connection's), errors typed."""
        try:
            return method(request, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def pages(self, method: Any, request: Any, field: str, timeout: float | None) -> Iterator[Any]:
        """Every item of a paginated list RPC: ``method(request)`` again with each
        ``next_page_token`` until there is none; ``field`` names the reply's repeated field."""
        while True:
            reply = self.call(method, request, timeout)
            yield from getattr(reply, field)
            if not reply.next_page_token:
                return
            request.page_token = reply.next_page_token

    def close(self) -> None:
        self.channel.close()
