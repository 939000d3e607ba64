"""A long-lived stream rechecks its caller's credential (services/scheduler/revocation.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from opentinker.errors import AuthenticationError
from opentinker.services.scheduler.revocation import while_not_revoked

pytestmark = pytest.mark.unit


async def slow_events() -> AsyncIterator[int]:
    for n in range(3):
        await asyncio.sleep(0.05)
        yield n


def test_a_check_that_cannot_answer_keeps_the_stream_and_a_revocation_ends_it() -> None:
    answers = iter([RedisConnectionError("Redis away"), False, True])

    async def revoked() -> bool:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def main() -> list[int]:
        seen = []
        with pytest.raises(AuthenticationError, match="revoked"):
            async for n in while_not_revoked(slow_events(), revoked, every_s=0.03):
                seen.append(n)
        return seen

    seen = asyncio.run(main())
    assert seen[:1] == [0]  # the outage's check did not end it; the third check did


def test_the_events_end_the_stream_when_the_key_holds() -> None:
    async def revoked() -> bool:
        return False

    async def main() -> list[int]:
        return [n async for n in while_not_revoked(slow_events(), revoked, every_s=0.01)]

    assert asyncio.run(main()) == [0, 1, 2]
