"""`python -m opentinker.services.scheduler.rebootstrap --redis-url URL`: the operator accepts
that Redis lost the scheduler's state and starts the deployment afresh (lost_state.py).

It writes a new instance marker into a Redis that holds none; the scheduler (running, or at its
next start) then makes its bootstrap credentials again (admin.key, worker.token, when it has a
bootstrap_dir) and serves an empty deployment: jobs, users and keys of before are gone, and
workers are told to stop the jobs they kept. A Redis that still holds a marker is left alone
(exit 1): restoring a backup needs no re-bootstrap.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import structlog

from opentinker.services.common.logging import configure_logging
from opentinker.services.scheduler.lost_state import MARKER_KEY, read_marker, write_new_marker
from opentinker.services.scheduler.stores import connect_redis

log = structlog.get_logger(__name__)


async def rebootstrap(redis_url: str) -> bool:
    """True when a new marker was written; False when Redis already holds one."""
    redis = connect_redis(redis_url)
    try:
        marker = await write_new_marker(redis)
        if marker is None:
            log.error(
                "rebootstrap_refused",
                reason=f"Redis holds a marker ({await read_marker(redis)}): its state is there; "
                f"to start afresh anyway, delete the key {MARKER_KEY} first",
            )
            return False
        log.warning("rebootstrapped", marker=marker, redis_url=redis_url)
        return True
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opentinker.services.scheduler.rebootstrap")
    parser.add_argument("--redis-url", required=True, help="the scheduler's Redis, e.g. redis://…")
    args = parser.parse_args(argv)
    configure_logging("rebootstrap")
    return 0 if asyncio.run(rebootstrap(args.redis_url)) else 1


if __name__ == "__main__":
    sys.exit(main())
