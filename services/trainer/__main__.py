"""Trainer process: settings -> launch file -> run the job -> exit code.

python -m opentinker.services.trainer --launch RUN_DIR/launch.json --rollout-address HOST:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from opentinker.services.common.launch import LaunchConfig
from opentinker.services.common.logging import configure_logging

from .service import run_job
from .settings import TrainerSettings


async def _main(launch: LaunchConfig, rollout_address: str, settings: TrainerSettings) -> int:
    task = asyncio.create_task(run_job(launch, rollout_address, settings))
    for sig in (signal.SIGTERM, signal.SIGINT):  # graceful: the loop closes the rollout stream
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        return 128 + signal.SIGTERM


def main() -> None:
    parser = argparse.ArgumentParser(description="OpenTinker trainer: runs one job's training.")
    parser.add_argument("--launch", type=Path, required=True, help="<run_dir>/launch.json")
    parser.add_argument("--rollout-address", required=True, help="host:port of the job's rollout")
    args = parser.parse_args()
    settings = TrainerSettings()
    log = configure_logging("trainer", level=settings.log_level)
    launch = LaunchConfig.read(args.launch)
    code = asyncio.run(_main(launch, args.rollout_address, settings))
    log.info("trainer_exit", code=code)
    sys.exit(code)


if __name__ == "__main__":
    main()
