"""Signed download URLs: the token is ``<base64 [file, expiry]>.<HMAC-SHA256>`` under a key
kept in a file, so a URL outlives a gateway restart."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets

from opentinker.services.gateway.settings import GatewaySettings
from opentinker.services.scheduler.tenants.credentials import load_or_create_secret

SECRET_NAME = ".gateway-download-secret"  # in the checkpoint root unless set elsewhere


def signing_secret(settings: GatewaySettings) -> bytes:
    """The key download URLs are signed with, from a file made once (random, mode 0600), so a
    URL outlives a gateway restart and works on every gateway sharing the file:
    ``download_secret_file``, else ``<checkpoint_root>/.gateway-download-secret``. With
    neither (no downloads are served then) a per-process key."""
    path = settings.download_secret_file
    if path is None and settings.checkpoint_root is not None:
        path = settings.checkpoint_root / SECRET_NAME
    if path is None:
        return secrets.token_bytes(32)
    return load_or_create_secret(path)


def sign(secret: bytes, file: str, expires: int) -> str:
    payload = base64.urlsafe_b64encode(json.dumps([file, expires]).encode()).decode()
    mac = hmac.new(secret, payload.encode(), hashlib.sha256).hexdigest()
    return f"{payload}.{mac}"


def verify(secret: bytes, token: str) -> tuple[str, int]:
    payload, _, mac = token.rpartition(".")
    want = hmac.new(secret, payload.encode(), hashlib.sha256).hexdigest()
    # As bytes: compare_digest raises TypeError on a str with non-ASCII characters.
    if not payload or not hmac.compare_digest(mac.encode(), want.encode()):
        raise ValueError("this download URL's signature is not valid")
    file, expires = json.loads(base64.urlsafe_b64decode(payload))
    return str(file), int(expires)
