"""Signed-in users: an unguessable cookie token -> a scheduler Client holding that user's API
key. The key never leaves the server after sign-in (the cookie carries only the token)."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

from opentinker.client import Client
from opentinker.scheduler.v1 import identity_pb2

COOKIE = "opentinker_session"


@dataclass
class SignedIn:
    """One browser's sign-in: its user's client and who the key says they are."""

    client: Client
    api_key: str
    tenant_id: str
    user_id: str
    last_seen: float = field(default_factory=time.monotonic)


class SignIns:
    """The dashboard's sign-ins, in memory (a restart signs everyone out)."""

    def __init__(self, *, scheduler_address: str, ca_file: str | None, timeout_s: float,
                 idle_s: float) -> None:  # fmt: skip
        self._address, self._ca_file = scheduler_address, ca_file
        self._timeout_s, self._idle_s = timeout_s, idle_s
        self._by_token: dict[str, SignedIn] = {}
        self._lock = threading.Lock()

    def sign_in(self, api_key: str) -> tuple[str, SignedIn]:
        """Check ``api_key`` with the scheduler (WhoAmI); AuthenticationError if it is not a
        live key. Returns the cookie token and the sign-in."""
        client = Client(
            self._address, api_key=api_key, timeout=self._timeout_s, ca_file=self._ca_file
        )
        try:
            principal: identity_pb2.Principal = client.whoami()
        except Exception:
            client.close()
            raise
        signed = SignedIn(client, api_key, principal.tenant_id, principal.user_id)
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._by_token[token] = signed
        self._close_idle()
        return token, signed

    def _close_idle(self) -> None:
        """Close every sign-in idle past ``idle_s``: a browser closed without signing out
        never sends its cookie again, and each sign-in holds a channel to the scheduler."""
        horizon = time.monotonic() - self._idle_s
        with self._lock:
            idle = [t for t, s in self._by_token.items() if s.last_seen < horizon]
            gone = [self._by_token.pop(t) for t in idle]
        for signed in gone:
            signed.client.close()

    def get(self, token: str | None) -> SignedIn | None:
        with self._lock:
            signed = self._by_token.get(token or "")
            if signed is None:
                return None
            if time.monotonic() - signed.last_seen > self._idle_s:
                del self._by_token[token or ""]
                signed.client.close()
                return None
            signed.last_seen = time.monotonic()
            return signed

    def sign_out(self, token: str | None) -> None:
        with self._lock:
            signed = self._by_token.pop(token or "", None)
        if signed is not None:
            signed.client.close()

    def close(self) -> None:
        with self._lock:
            signed_ins, self._by_token = list(self._by_token.values()), {}
        for signed in signed_ins:
            signed.client.close()
