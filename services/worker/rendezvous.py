"""The environment a worker's part of a multi-worker job runs with (LaunchJob.rendezvous).

torchrun's names, so a rank launcher maps them one to one: ``torchrun --nnodes $NNODES
--node_rank $NODE_RANK --nproc_per_node <devices leased here> --master_addr $MASTER_ADDR
--master_port $MASTER_PORT`` (ranks are numbered node by node, so this worker's local rank i is
global rank RANK_START + i); or, without torchrun, ``init_process_group(init_method=
f"tcp://{MASTER_ADDR}:{MASTER_PORT}", rank=RANK_START + i, world_size=WORLD_SIZE)``.
"""

from __future__ import annotations

from opentinker.scheduler.v1 import scheduler_pb2


def rendezvous_env(launch: scheduler_pb2.LaunchJob) -> dict[str, str]:
    """MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NNODES, NODE_RANK, RANK_START, LOCAL_WORLD_SIZE
    for a part of a multi-worker job; {} for a one-worker job."""
    if not launch.HasField("rendezvous"):
        return {}
    r = launch.rendezvous
    return {
        "MASTER_ADDR": r.master_addr,
        "MASTER_PORT": str(r.master_port),
        "WORLD_SIZE": str(r.world_size),
        "NNODES": str(r.num_nodes),
        "NODE_RANK": str(r.node_rank),
        "RANK_START": str(r.rank_start),
        "LOCAL_WORLD_SIZE": str(len(launch.device_ids)),
    }
