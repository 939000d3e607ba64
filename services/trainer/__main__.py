"""Trainer process: settings -> launch file -> run the job -> exit code.

python -m opentinker.services.trainer --launch RUN_DIR/launch.json --rollout-address HOST:PORT
python -m opentinker.services.trainer --launch RUN_DIR/launch.json --rollout-address-file F
    (F: the file the job's rollout, started at the same time, writes its HOST:PORT to)
python -m opentinker.services.trainer --launch RUN_DIR/launch.json     (an SFT job: no rollout)
python -m opentinker.services.trainer --spare [--preload-model M]   (a warm spare: spare.py)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import signal
import sys
from pathlib import Path

from opentinker.services.common.cpu_share import follow_job_share
from opentinker.services.common.launch import LaunchConfig
from opentinker.services.common.logging import configure_logging
from opentinker.services.modeling.preload import Preload
from opentinker.services.modeling.spare import Handover, serve_jobs
from opentinker.services.trainer.rollout_link.rollout_address import RolloutAddress
from opentinker.services.trainer.service import run_job
from opentinker.services.trainer.settings import TrainerSettings


async def _main(
    launch: LaunchConfig,
    rollout: RolloutAddress | None,
    settings: TrainerSettings,
    preload: Preload | None,
) -> int:
    # compute threads by the jobs the worker runs now, and the job's processes computing at once
    follow_job_share(launch)
    task = asyncio.create_task(run_job(launch, rollout, settings, preload))
    for sig in (signal.SIGTERM, signal.SIGINT):  # graceful: the loop closes the rollout stream
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        return 128 + signal.SIGTERM


def main() -> None:
    parser = argparse.ArgumentParser(description="OpenTinker trainer: runs one job's training.")
    parser.add_argument("--launch", type=Path, help="<run_dir>/launch.json")
    parser.add_argument("--rollout-address", help="host:port of the job's rollout (RL jobs)")
    parser.add_argument(
        "--rollout-address-file",
        type=Path,
        help="or the file the job's rollout writes its host:port to once it serves (read when "
        "the trainer opens the rollout, so both can start at once)",
    )
    parser.add_argument(
        "--rollout-address-timeout",
        type=float,
        help="seconds to wait for that file (the worker passes its own wait for the rollout and "
        "a grace; default: TrainerSettings.rollout_address_timeout_s)",
    )
    parser.add_argument("--spare", action="store_true", help="wait for a job on stdin (spare.py)")
    parser.add_argument("--preload-model", help="spare: the base model to load while waiting")
    args = parser.parse_args()
    if args.spare:  # imports and the model load happen before the job is known
        serve_jobs("trainer", args.preload_model, lambda p, h: _run(_handed(args, h), p, h))
    if args.launch is None:
        parser.error("--launch is required (or --spare)")
    sys.exit(_run(args, None))


def _handed(args: argparse.Namespace, handover: Handover) -> argparse.Namespace:
    """The arguments of the job a spare was handed."""
    return argparse.Namespace(
        **{
            **vars(args),
            "launch": handover.launch,
            "rollout_address": handover.rollout_address,
            "rollout_address_file": handover.rollout_address_file,
            "rollout_address_timeout": handover.rollout_address_timeout_s,
        }
    )


@functools.cache
def _settings() -> TrainerSettings:
    """Read from the environment once: a spare reused for many jobs has the same one for each
    (its hand-over sets CUDA_VISIBLE_DEVICES only), and reading it costs ~50 ms of CPU."""
    return TrainerSettings()


def _run(
    args: argparse.Namespace, preload: Preload | None, handover: Handover | None = None
) -> int:
    """One job, start to end: its exit code. ``handover``: how a spare was handed it."""
    settings = _settings()
    log = configure_logging("trainer", level=settings.log_level)
    launch = LaunchConfig.read(args.launch)
    rollout = RolloutAddress.given(
        args.rollout_address, args.rollout_address_file, args.rollout_address_timeout
    )
    code = asyncio.run(_main(launch, rollout, settings, preload))
    # A rank's sharded policy holds its (left) process group: free both while the interpreter
    # is whole; gloo's threads abort the process when the group is freed during exit. (A
    # reused spare, never a rank, collects after it has reported the job's end: spare.py.)
    if handover is None or not handover.reusable:
        gc.collect()
    log.info("trainer_exit", code=code)
    return code


if __name__ == "__main__":
    main()
