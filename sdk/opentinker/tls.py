"""TLS for gRPC channels: the CA that signed the services' certificates, from an argument or
``$OPENTINKER_TLS_CA_FILE``. Without one, channels are plaintext (fine on loopback, which is
where the services listen by default)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc

CA_FILE_ENV = "OPENTINKER_TLS_CA_FILE"


def ca_file_from_env(ca_file: str | Path | None = None) -> Path | None:
    """``ca_file`` if given, else ``$OPENTINKER_TLS_CA_FILE``, else None."""
    chosen = ca_file if ca_file is not None else os.environ.get(CA_FILE_ENV) or None
    return Path(chosen) if chosen else None


def channel_credentials(ca_file: Path | None) -> grpc.ChannelCredentials | None:
    """Credentials trusting the CA in ``ca_file`` (PEM), or None for a plaintext channel."""
    if ca_file is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())


def open_channel(address: str, *, ca_file: Path | None, options: list) -> grpc.Channel:
    """A blocking channel to ``address``: TLS when ``ca_file`` is given, plaintext otherwise."""
    credentials = channel_credentials(ca_file)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)
