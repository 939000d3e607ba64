"""Who is calling: the X-API-Key header holds one of our API keys, checked by the scheduler.

The Tinker SDK refuses keys that do not start with ``tml-``, so users pass ``tml-`` + their
OpenTinker key (``tml-otk_...``); the gateway drops that prefix and acts with the key itself,
so the scheduler and trainers see the user exactly as they would over gRPC (same tenant,
quotas and accounting). Keys are checked with the scheduler's WhoAmI and trusted for
``key_cache_s`` seconds (default 2: a revoked key is refused within that).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import opentinker
from opentinker.errors import AuthenticationError, PermissionDeniedError
from opentinker.scheduler.v1 import identity_pb2

TINKER_PREFIX = "tml-"


@dataclass
class Caller:
    key: str  # our API key, the tml- prefix dropped
    tenant_id: str
    client: opentinker.Client
    checked_at: float


class Tenancy:
    def __init__(self, scheduler_address: str, *, cache_s: float, timeout: float) -> None:
        self.scheduler_address = scheduler_address
        self.cache_s = cache_s
        self.timeout = timeout
        self._callers: dict[str, Caller] = {}

    async def caller(self, header: str | None) -> Caller:
        """The caller of a request; AuthenticationError for a missing or unknown key."""
        if not header:
            raise AuthenticationError("X-API-Key: missing; pass your OpenTinker key as tml-<key>")
        key = header.removeprefix(TINKER_PREFIX)
        known = self._callers.get(key)
        if known is not None and time.monotonic() - known.checked_at < self.cache_s:
            return known
        client = known.client if known else self._client(key)
        try:
            principal = await asyncio.to_thread(client.whoami, timeout=10)
        except AuthenticationError:
            self._callers.pop(key, None)
            client.close()
            raise
        except Exception:  # the scheduler away, say: a client made for this check goes too
            if known is None:
                client.close()
            raise
        if principal.kind != identity_pb2.PRINCIPAL_KIND_USER:  # a worker's or a job's token
            self._callers.pop(key, None)
            client.close()
            raise PermissionDeniedError(
                "X-API-Key: a worker or job token cannot use the Tinker API (it would act "
                "for no user); pass a user's API key as tml-<key>"
            )
        caller = Caller(key, principal.tenant_id, client, time.monotonic())
        self._callers[key] = caller
        return caller

    def _client(self, key: str) -> opentinker.Client:
        return opentinker.Client(self.scheduler_address, api_key=key, timeout=self.timeout)

    def close(self) -> None:
        for caller in self._callers.values():
            caller.client.close()
        self._callers.clear()
