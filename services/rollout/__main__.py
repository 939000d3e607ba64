"""python -m opentinker.services.rollout --launch RUN_DIR/launch.json  (or --envhub-address A)

``--spare [--preload-model M]``: a warm spare; the launch file comes on stdin (modeling/spare.py).
``--shared-base M --capacity N [--max-lora-rank R] --addr-file F --scheduler-address A``: a
node's shared engine for LoRA jobs of base model M (shared_server.py).

A job's rollout exits 0 when signalled, and exit_codes.PEER_LOST when its trainer left the
stream unclosed (stopped answering, or gone): the worker then ends the attempt as lost.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import torch

from opentinker.grpc_options import host_port
from opentinker.services.common.cpu_share import follow_job_share
from opentinker.services.common.exit_codes import PEER_LOST
from opentinker.services.common.heap import frozen_after
from opentinker.services.common.launch import LaunchConfig, write_atomic
from opentinker.services.common.logging import configure_logging
from opentinker.services.modeling.placement import placement_here
from opentinker.services.modeling.preload import Preload
from opentinker.services.modeling.spare import Handover, serve_jobs
from opentinker.services.rollout.engines.engine_choice import engine_factory, vllm_installed
from opentinker.services.rollout.engines.kept_engine import kept_engine_factory
from opentinker.services.rollout.service import create_server
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.shared.shared_server import (
    DEFAULT_MAX_LORA_RANK,
    SharedOptions,
    start_shared,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Serve the OpenTinker rollout (generation + agent loop)."
    )
    parser.add_argument("--launch", type=Path, help="launch.json written by the worker agent")
    parser.add_argument("--envhub-address", help="host:port of EnvHub (overrides the launch file)")
    parser.add_argument("--port", type=int, help="port to listen on (default: any free port)")
    parser.add_argument("--spare", action="store_true", help="wait for a job on stdin (spare.py)")
    parser.add_argument("--preload-model", help="spare: the base model to load while waiting")
    parser.add_argument("--shared-base", help="serve LoRA jobs of this base model on one engine")
    parser.add_argument("--capacity", type=int, default=8, help="shared: most jobs at once")
    parser.add_argument(
        "--max-lora-rank", type=int, default=DEFAULT_MAX_LORA_RANK, help="shared: largest rank"
    )
    parser.add_argument("--addr-file", type=Path, help="shared: where to write host:port")
    parser.add_argument("--scheduler-address", help="shared: whose IdentityService checks tokens")
    return parser.parse_args()


async def main_shared(args: argparse.Namespace) -> None:
    if args.addr_file is None or not args.scheduler_address:
        raise SystemExit("--shared-base needs --addr-file and --scheduler-address")
    settings = RolloutSettings.with_overrides(envhub_address=args.envhub_address, port=args.port)
    log = configure_logging("rollout", level=settings.log_level)
    options = SharedOptions(
        args.shared_base,
        args.capacity,
        args.addr_file,
        args.scheduler_address,
        max_lora_rank=args.max_lora_rank,
    )
    server, identity = await start_shared(options, settings)
    await _until_signalled()
    log.info("rollout_stopping")
    await server.stop(grace=5.0)
    await identity.close()


async def _until_signalled(stop: asyncio.Event | None = None, *, job: bool = False) -> None:
    """Until SIGTERM or SIGINT, or ``stop`` is set. A ``job``'s rollout also ends its job on
    SIGUSR1: the worker's "job over" to a reusable spare (modeling/spare.py), which then stays."""
    stop = stop or asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, *((signal.SIGUSR1,) if job else ())):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()


async def main(args: argparse.Namespace, preload: Preload | None = None) -> int:
    """Serve until signalled (0) or, for a job, until its trainer is lost (PEER_LOST)."""
    launch = LaunchConfig.read(args.launch) if args.launch else None
    # compute threads by the jobs the worker runs now, and the job's processes computing at once
    follow_job_share(launch)
    envhub_address = args.envhub_address or (launch.envhub_address if launch else None)
    settings = RolloutSettings.with_overrides(
        envhub_address=envhub_address,
        port=args.port,
        credential=launch.job_token if launch else None,  # else OPENTINKER_ROLLOUT_CREDENTIAL
    )
    log = configure_logging("rollout", level=settings.log_level)
    if launch is not None:  # the trainer reads the same lease by the same rule (placement.py)
        placement = placement_here(launch.device_ids, override=settings.device)
        settings = settings.model_copy(update={"device": placement.device})
        log.info("placement", device=placement.device, dtype=str(placement.dtype))
    job = launch.job if launch else None
    engine, factory = engine_factory(
        settings, cuda_available=torch.cuda.is_available(), vllm_importable=vllm_installed()
    )
    if preload is not None and engine == "transformers":  # a spare preloads for transformers
        factory = kept_engine_factory(
            preload, factory, max_batch_size=settings.max_batch_size, device=settings.device or None
        )
    if launch is not None:  # one job's process: its engine stays loaded to the end
        factory = frozen_after(factory, "engine")
    stop, trainer_lost = asyncio.Event(), []

    def lost(why: str) -> None:  # the attempt cannot go on: the worker ends it
        if not stop.is_set():
            trainer_lost.append(why)
            stop.set()

    server, port = await create_server(
        settings,
        engine_factory=factory,
        job_id=job.job_id if job else "",
        attempt=job.attempt if job else 0,
        on_trainer_lost=lost if launch is not None else None,
    )
    if launch is not None:
        write_atomic(launch.run_dir / "rollout.addr", host_port(settings.host, port))
    await _until_signalled(stop, job=launch is not None)
    if trainer_lost:
        log.error("trainer_lost", reason=trainer_lost[0], exit_code=PEER_LOST)
    log.info("rollout_stopping")
    await server.stop(grace=5.0)
    return PEER_LOST if trainer_lost else 0


def run() -> None:
    args = parse_args()
    if args.shared_base:
        asyncio.run(main_shared(args))
        return
    if args.spare:  # imports and the model load happen before the job is known
        serve_jobs("rollout", args.preload_model, lambda p, h: _run_handed(args, p, h))
    sys.exit(asyncio.run(main(args)))


def _run_handed(args: argparse.Namespace, preload: Preload, handover: Handover) -> int:
    handed = argparse.Namespace(**{**vars(args), "launch": handover.launch})
    return asyncio.run(main(handed, preload))


if __name__ == "__main__":
    run()
