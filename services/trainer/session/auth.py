"""Who may call a session's trainer: its own job token (checked locally), or a user's API key
checked by the scheduler's IdentityService (the servicer then admits only the job's tenant)."""

from __future__ import annotations

from opentinker.errors import AuthenticationError
from opentinker.services.common.auth import (
    IdentityServiceAuthenticator,
    OwnCredentialAuthenticator,
    Principal,
)


class SessionAuthenticator:
    def __init__(
        self, own: OwnCredentialAuthenticator, identity: IdentityServiceAuthenticator
    ) -> None:
        self._own = own
        self._identity = identity

    async def authenticate(self, credential: str) -> Principal:
        try:
            return await self._own.authenticate(credential)
        except AuthenticationError:
            return await self._identity.authenticate(credential)
