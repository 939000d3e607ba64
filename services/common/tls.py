"""TLS settings shared by every service process (OPENTINKER_TLS_* variables).

With a certificate and key, a service serves TLS only; with a CA file, every channel it opens
to another service (and the SDK, see opentinker.tls) verifies that CA. Both unset: plaintext,
which is what loopback-only single-node setups use.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TlsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OPENTINKER_TLS_", extra="ignore", frozen=True)

    cert_file: Path | None = None  # PEM certificate (chain) this process serves with
    key_file: Path | None = None  # its PEM private key
    ca_file: Path | None = None  # PEM CA that the other services' certificates chain to

    @model_validator(mode="after")
    def _pair(self) -> TlsSettings:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "OPENTINKER_TLS_CERT_FILE and OPENTINKER_TLS_KEY_FILE go together: set both "
                "to serve TLS, or neither"
            )
        return self

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.cert_file is None or self.key_file is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.key_file.read_bytes(), self.cert_file.read_bytes())]
        )
