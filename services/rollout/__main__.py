"""python -m opentinker.services.rollout --launch RUN_DIR/launch.json  (or --envhub-address A)"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from opentinker.services.common.launch import LaunchConfig, write_atomic
from opentinker.services.common.logging import configure_logging

from .service import create_server
from .settings import RolloutSettings


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Serve the OpenTinker rollout (generation + agent loop)."
    )
    parser.add_argument("--launch", type=Path, help="launch.json written by the worker agent")
    parser.add_argument("--envhub-address", help="host:port of EnvHub (overrides the launch file)")
    parser.add_argument("--port", type=int, help="port to listen on (default: any free port)")
    return parser.parse_args()


async def main() -> None:
    args = parse_args()
    launch = LaunchConfig.read(args.launch) if args.launch else None
    envhub_address = args.envhub_address or (launch.envhub_address if launch else None)
    settings = RolloutSettings.with_overrides(
        envhub_address=envhub_address,
        port=args.port,
        credential=launch.job_token if launch else None,  # else OPENTINKER_ROLLOUT_CREDENTIAL
    )
    log = configure_logging("rollout", level=settings.log_level)
    job = launch.job if launch else None
    server, port = await create_server(
        settings, job_id=job.job_id if job else "", attempt=job.attempt if job else 0
    )
    if launch is not None:
        write_atomic(launch.run_dir / "rollout.addr", f"{settings.host}:{port}")
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("rollout_stopping")
    await server.stop(grace=5.0)


if __name__ == "__main__":
    asyncio.run(main())
