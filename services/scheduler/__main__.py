"""`python -m opentinker.services.scheduler`: settings -> Redis stores -> serve -> shut down."""

from __future__ import annotations

import asyncio
import signal

from opentinker.services.common.launch import publish_address
from opentinker.services.common.logging import configure_logging
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings


async def main() -> None:
    settings = SchedulerSettings()  # type: ignore[call-arg]  # redis_url comes from the env
    log = configure_logging("scheduler", level=settings.log_level)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)

    async with running_scheduler(settings) as running:
        log.info("serving", host=settings.host, port=running.port, redis_url=settings.redis_url)
        publish_address(settings.address_file, settings.host, running.port)
        await stop.wait()
        log.info("shutting_down")


if __name__ == "__main__":
    asyncio.run(main())
