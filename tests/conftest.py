"""Shared fixtures: one real redis-server per test session.

- ``redis_server_url`` (session): the URL of a real ``redis-server`` started once for the whole
  session in a temporary folder (services.launcher.redis_process.RedisProcess).
- ``redis_url`` (function): the same URL, with database 0 emptied (FLUSHDB) before the test,
  so each test starts from a clean Redis. Use this one in tests.

Async tests here are plain functions that call ``asyncio.run(...)``; no plugin is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from opentinker.services.launcher.redis_process import RedisProcess


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data_dir: Path = tmp_path_factory.mktemp("redis")
    with RedisProcess(data_dir) as server:
        yield server.url


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    import redis  # server-side dependency; imported here so SDK-only tests never need it

    client = redis.Redis.from_url(redis_server_url)
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_server_url
