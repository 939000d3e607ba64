"""A long-lived stream rechecks its caller's credential (services/common/revocation.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from opentinker.errors import AuthenticationError
from opentinker.services.common.revocation import until_revoked, while_not_revoked

pytestmark = pytest.mark.unit


async def slow_events() -> AsyncIterator[int]:
    for n in range(3):
        await asyncio.sleep(0.05)
        yield n


def answering(*answers: bool | Exception) -> Callable[[], Awaitable[bool]]:
    """A check that gives ``answers`` in turn (an exception: it cannot answer)."""
    given = iter(answers)

    async def revoked() -> bool:
        answer = next(given)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return revoked


def test_a_check_that_cannot_answer_keeps_the_stream_and_a_revocation_ends_it() -> None:
    revoked = answering(RedisConnectionError("Redis away"), False, True)

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


def test_a_revocation_ends_a_stream_whose_items_never_pause() -> None:
    """Items closer together than the check interval must not put the check off for good
    (a watched job reporting faster than the heartbeat, episodes served back to back)."""
    revoked_at: list[float] = []

    async def busy() -> AsyncIterator[int]:
        n = 0
        while True:
            await asyncio.sleep(0.01)
            n += 1
            yield n

    async def revoked() -> bool:
        return bool(revoked_at)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, lambda: revoked_at.append(time.monotonic()))
        with pytest.raises(AuthenticationError, match="revoked"):
            async for _ in while_not_revoked(busy(), revoked, every_s=0.05):
                pass
        return time.monotonic() - revoked_at[0]

    assert asyncio.run(asyncio.wait_for(main(), 5)) < 0.5


def test_until_revoked_cancels_the_work_and_lets_it_clean_up() -> None:
    cleaned: list[str] = []
    revoked = answering(RedisConnectionError("Redis away"), False, True)

    async def serve_forever() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append("closed")

    async def main() -> None:
        with pytest.raises(AuthenticationError, match="revoked"):
            await until_revoked(serve_forever(), revoked, every_s=0.02)

    asyncio.run(asyncio.wait_for(main(), 5))
    assert cleaned == ["closed"]  # its finally ran before the error came out


def test_until_revoked_returns_what_the_work_returns_while_the_key_holds() -> None:
    async def revoked() -> bool:
        return False

    async def work() -> str:
        await asyncio.sleep(0.05)
        return "done"

    assert asyncio.run(until_revoked(work(), revoked, every_s=0.01)) == "done"
