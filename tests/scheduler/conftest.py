"""Fixtures of the scheduler tests.

- ``redis_server`` (function): a Redis of the test's own (AOF on), which the test may kill and
  start again (the Redis-outage and lost-state tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from opentinker.services.launcher.redis_process import RedisProcess


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A Redis of the test's own (AOF on), which a test may kill and start again."""
    server = RedisProcess(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
