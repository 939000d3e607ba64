"""One rank of a multi-worker job's rendezvous check (run as a process by test_multinode.py).

Reads what a worker exports for its part (services/worker/rendezvous.py) plus LOCAL_RANK, joins
the gloo group at MASTER_ADDR:MASTER_PORT and all-reduces the ranks; prints one JSON line.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["RANK_START"]) + int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group(
        "gloo", init_method=address, rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "world_size": world_size, "sum_of_ranks": total.item()}))


if __name__ == "__main__":
    main()
