"""Making and checking credentials: random secrets, public prefixes, HMAC digests.

A credential is ``ot<k|j|w>_<prefix>_<secret>``: ``k`` an API key of a user, ``j`` a job token,
``w`` a worker token. The prefix (12 hex digits) is public and names the credential in
listings and logs; the secret (256 random bits) is shown once. Redis keeps only
HMAC-SHA256(server secret, credential), so a copy of the database does not let anyone in.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

import structlog

from opentinker.auth import KIND_LETTERS

log = structlog.get_logger(__name__)

_LETTER_OF_KIND = {kind: letter for letter, kind in KIND_LETTERS.items()}
SECRET_BYTES = 32


def mint(kind: str) -> tuple[str, str]:
    """A new credential of ``kind`` ("user", "job", "worker"): (credential, prefix)."""
    prefix = secrets.token_hex(6)
    return f"ot{_LETTER_OF_KIND[kind]}_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}", prefix


def digest(server_secret: bytes, credential: str) -> str:
    """What is stored for ``credential``: hex HMAC-SHA256 under the server secret."""
    return hmac.new(server_secret, credential.encode(), hashlib.sha256).hexdigest()


def matches(server_secret: bytes, credential: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(server_secret, credential), stored_digest)


def load_or_create_secret(path: Path) -> bytes:
    """The server secret in ``path``; made (random, mode 0600) when the file does not exist."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        log.info("auth_secret_created", path=str(path))
    text = path.read_text().strip()
    if len(text) < 32:
        raise ValueError(f"{path}: the auth secret must be at least 32 characters")
    return text.encode()
