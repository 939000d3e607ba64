"""A trainer process that is one rank of a job on several devices (the worker starts one per
device with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; worker/ranks.py).

Rank 0 runs the job as ``service.run_job`` always does, on a ``LeaderPolicy`` (``lead``);
every other rank runs ``run_follower``: load the same policy, join the process group, shard,
and follow rank 0's orders until it says stop (ranks.py).
"""

from __future__ import annotations

import asyncio
import os

import structlog

from opentinker.errors import ConfigError
from opentinker.services.common.exit_codes import RETRY_LATER
from opentinker.services.common.heap import freeze_loaded_heap
from opentinker.services.common.launch import LaunchConfig
from opentinker.services.modeling.placement import placement_here
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.parallel.distributed import (
    Rank,
    group_broke,
    init_rank,
    leave_group,
    shard_policy,
)
from opentinker.services.trainer.parallel.ranks import LeaderPolicy, check_data_parallel, follow
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.spec import JobSpec, from_proto

log = structlog.get_logger()


def world_from_env() -> Rank | None:
    """This process's rank when the worker started it as one of several (WORLD_SIZE > 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size <= 1:
        return None
    return Rank(int(os.environ.get("RANK", "0")), world_size)


def rank_device(device: str) -> str:
    """Each rank on its own GPU (LOCAL_RANK); CPU ranks share the CPU."""
    if device.startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


async def lead(policy: Policy, settings: TrainerSettings) -> LeaderPolicy:
    """Rank 0: join the group, shard ``policy`` and wrap it for the loop."""
    rank = await asyncio.to_thread(init_rank, str(policy.device), timeout_s=settings.rank_timeout_s)
    await asyncio.to_thread(shard_policy, policy)
    log.info("rank_leading", world_size=rank.world_size)
    return LeaderPolicy(policy, rank)


def release(leader: LeaderPolicy) -> None:
    """Tell the followers to stop, then leave the group with them (best effort: a broken
    group has already failed the job)."""
    try:
        leader.stop()
        leave_group(peers_alive=True)
    except (RuntimeError, ValueError) as err:  # a dead peer: the worker ends the rest
        log.warning("followers_not_released", error=str(err))
        leave_group(peers_alive=False)


async def run_follower(launch: LaunchConfig, settings: TrainerSettings, me: Rank) -> int:
    """A follower's whole process: 0 when rank 0 released it (also when the job cannot run
    on several ranks: rank 0 reports why); exit_codes.RETRY_LATER when the group broke under
    it (rank 0 died, hung, or its node was lost: the attempt is lost, the job re-queued;
    rank 0 releases its followers whenever it ends by itself, failed or not); 1 when this
    rank failed by itself."""
    rank_log = log.bind(job_id=launch.job.job_id, rank=me.rank, world_size=me.world_size)
    try:
        spec = from_proto(launch.job.spec)
        check_data_parallel(spec, me.world_size)
        placement = placement_here(launch.device_ids, override=settings.device)
    except ConfigError as err:
        rank_log.info("rank_not_needed", reason=str(err))
        return 0
    device = rank_device(placement.device)
    released = False
    try:
        rank = await asyncio.to_thread(init_rank, device, timeout_s=settings.rank_timeout_s)
        await asyncio.to_thread(_follow_job, spec, device, rank)
        released = True
    except Exception as err:  # a peer died or timed out: say so and end this rank
        rank_log.error("rank_failed", error=f"{type(err).__name__}: {err}")
        return RETRY_LATER if group_broke(err) else 1
    finally:  # the sharded policy died with _follow_job: the group goes with it
        await asyncio.to_thread(leave_group, peers_alive=released)
    return 0


def _follow_job(spec: JobSpec, device: str, rank: Rank) -> None:
    """Load and shard the job's policy, then follow rank 0 until it says stop."""
    assert spec.rl is not None  # check_data_parallel: an RL job
    policy = Policy(
        spec.model, learning_rate=spec.rl.learning_rate, device=device, seed=spec.rl.seed
    )
    shard_policy(policy)
    freeze_loaded_heap("policy")
    follow(policy, rank)
