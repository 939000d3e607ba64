"""`python -m opentinker.services.worker`: settings -> devices -> serve the scheduler -> stop."""

from __future__ import annotations

import asyncio
import signal

from opentinker.services.common.logging import configure_logging
from opentinker.services.worker.agent import WorkerAgent
from opentinker.services.worker.devices import detect_devices
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.worker_id import with_stable_worker_id


async def main() -> None:
    settings = with_stable_worker_id(WorkerSettings())  # the same id after a restart
    log = configure_logging("worker", level=settings.log_level)
    devices = detect_devices(settings)
    log.info("starting", worker_id=settings.worker_id, devices=[d.device_id for d in devices])

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    # Returns once every job process is stopped and the scheduler was told we are closing.
    await WorkerAgent(settings, devices).run(stop)
    log.info("stopped")


if __name__ == "__main__":
    asyncio.run(main())
