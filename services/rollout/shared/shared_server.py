"""A node's shared rollout for one base model: many LoRA jobs' adapters on one engine.

``python -m opentinker.services.rollout --shared-base MODEL --capacity N [--max-lora-rank R]
--addr-file PATH --scheduler-address A --envhub-address E``: started by the worker agent
(worker/shared_rollouts.py) for the first LoRA job of MODEL on its node, stopped when the last
one leaves. It holds no credential of its own: every stream's job token is checked by the
scheduler's IdentityService, and each job's EnvHub calls carry that job's token. The engine is
chosen as a private rollout's is (engine_choice.py): vLLM's multi-LoRA on CUDA
(vllm_multi_lora.py), peft's elsewhere.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
import torch

from opentinker.grpc_options import host_port
from opentinker.services.common.auth import IdentityServiceAuthenticator
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.common.launch import write_atomic
from opentinker.services.rollout.engines.engine_choice import shared_engine_loader, vllm_installed
from opentinker.services.rollout.service import create_server
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.shared.batcher import DEFAULT_WINDOW_S, MixedBatcher
from opentinker.services.rollout.shared.shared_engine import SharedAdapters

log = structlog.get_logger("opentinker.rollout.shared")

DEFAULT_MAX_LORA_RANK = 64


@dataclass(frozen=True)
class SharedOptions:
    """base_model: the one base model served; capacity: most adapters (jobs) at once;
    addr_file: where host:port is written once serving; window_s: the batcher's wait;
    max_lora_rank: the largest adapter rank admitted (vLLM sizes its LoRA slots by it)."""

    base_model: str
    capacity: int
    addr_file: Path
    scheduler_address: str
    window_s: float = DEFAULT_WINDOW_S
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK


async def start_shared(
    options: SharedOptions, settings: RolloutSettings
) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    """Load the base model, serve, write the address; returns the server and the channel to
    the scheduler (close both to stop)."""
    if options.capacity < 1:
        raise ValueError(f"--capacity must be at least 1, got {options.capacity}")
    # Every job's engine call waits in a thread of this pool while the batcher merges them:
    # the default pool (cores + 4 threads) would cap how many jobs share one call.
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=2 * options.capacity + 4, thread_name_prefix="shared")
    )
    _, load = shared_engine_loader(
        settings,
        base_model=options.base_model,
        capacity=options.capacity,
        max_lora_rank=options.max_lora_rank,
        cuda_available=torch.cuda.is_available(),
        vllm_importable=vllm_installed(),
    )
    engine = await asyncio.to_thread(load)
    shared = SharedAdapters(
        MixedBatcher(engine, window_s=options.window_s), capacity=options.capacity
    )
    identity = aio_channel(options.scheduler_address)
    server, port = await create_server(
        settings,
        shared=shared,
        authenticator=IdentityServiceAuthenticator(identity, address=options.scheduler_address),
    )
    write_atomic(options.addr_file, host_port(settings.host, port))
    log.info("shared_rollout_serving", base_model=options.base_model, capacity=options.capacity)
    return server, identity
