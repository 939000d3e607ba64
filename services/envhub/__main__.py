"""``python -m opentinker.services.envhub``: settings -> its port -> built-in envs -> serve."""

from __future__ import annotations

import asyncio
import signal

from opentinker.services.common.launch import publish_address
from opentinker.services.common.logging import configure_logging
from opentinker.services.envhub.server import EnvHubDeps, bind_envhub, start_envhub
from opentinker.services.envhub.settings import EnvHubSettings


async def main() -> None:
    settings = EnvHubSettings()
    log = configure_logging("envhub", level=settings.log_level)
    # its port first: the built-in env servers take theirs after
    bound = await bind_envhub(settings)
    deps = EnvHubDeps.create(settings)
    server, port = await start_envhub(bound, settings, deps)
    log.info(
        "serving",
        host=settings.host,
        port=port,
        builtin_envs=settings.builtin_envs,
        health_check_interval_s=settings.health_check_interval_s,
    )
    publish_address(settings.address_file, settings.host, port)

    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()

    log.info("stopping")
    await server.stop(grace=2.0)
    await deps.close()  # stops the health watch that create_server started


if __name__ == "__main__":
    asyncio.run(main())
