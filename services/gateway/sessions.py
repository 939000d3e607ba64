"""Tinker sessions and their heartbeats: the SDK beats every 10 s while a ServiceClient lives.
A session not heard from for ``expiry_s`` (heartbeats, or calls on its models) has lost its
client: the gateway closes its training models (their jobs end and free their devices) and
answers its later heartbeats 410 Gone, which stops the SDK's heartbeat loop."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from opentinker.errors import NotFoundError


class SessionGoneError(NotFoundError):
    """The session finished or expired (HTTP 410)."""


@dataclass
class _Session:
    tenant_id: str
    seen_at: float
    busy: int = 0  # calls of it in progress: it does not expire meanwhile


class Sessions:
    def __init__(self, *, expiry_s: float) -> None:
        self.expiry_s = expiry_s
        self._live: dict[str, _Session] = {}

    def create(self, tenant_id: str) -> str:
        session_id = f"ses-{uuid.uuid4().hex[:16]}"
        self._live[session_id] = _Session(tenant_id, time.monotonic())
        return session_id

    def beat(self, session_id: str, tenant_id: str) -> None:
        """A sign of life; SessionGoneError for a session finished, expired or not the caller's."""
        self._owned(session_id, tenant_id).seen_at = time.monotonic()

    def check(self, session_id: str, tenant_id: str) -> None:
        """SessionGoneError unless ``session_id`` is a live session of ``tenant_id``: a model
        made in another's session would take one of its ids, and one made in an ended
        session would never be closed."""
        self._owned(session_id, tenant_id)

    def _owned(self, session_id: str, tenant_id: str) -> _Session:
        session = self._live.get(session_id)
        if session is None or session.tenant_id != tenant_id:
            raise SessionGoneError(f"session_id: session {session_id!r} has ended (or never was)")
        return session

    @contextlib.contextmanager
    def active(self, name: str | None) -> Iterator[None]:
        """A call naming a session or one of its models (``<session>:train:<n>``) keeps the
        session alive while it runs and counts as a sign of life."""
        session = self._live.get(name.split(":", 1)[0]) if name else None
        if session is None:
            yield
            return
        session.busy += 1
        try:
            yield
        finally:
            session.busy -= 1
            session.seen_at = time.monotonic()

    def finish(self, session_id: str, tenant_id: str) -> None:
        """End the caller's session; another tenant's is left alone (as one that never was)."""
        session = self._live.get(session_id)
        if session is not None and session.tenant_id == tenant_id:
            del self._live[session_id]

    def expired(self) -> list[str]:
        """Sessions silent for longer than ``expiry_s``; they are forgotten as they are named."""
        horizon = time.monotonic() - self.expiry_s
        gone = [sid for sid, s in self._live.items() if s.seen_at < horizon and not s.busy]
        for session_id in gone:
            del self._live[session_id]
        return gone
