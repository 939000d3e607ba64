"""One rank of a 2-rank gloo group whose rank 1 dies right after joining (run as a process by
tests/trainer/test_group_broke.py): rank 0's next collective fails, and it prints whether
trainer/distributed.group_broke calls that the group breaking (one JSON line)."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from opentinker.services.trainer.parallel.distributed import group_broke


def main() -> None:
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=20),
    )
    dist.barrier()
    if rank == 1:
        os._exit(0)  # dies as a lost node's rank would: no goodbye
    try:
        for _ in range(100):
            dist.all_reduce(torch.ones(4))
    except Exception as err:  # noqa: BLE001 - what is printed is what the test checks
        print(json.dumps({"type": type(err).__name__, "group_broke": group_broke(err)}))
        return
    print(json.dumps({"type": "none", "group_broke": False}))


if __name__ == "__main__":
    main()
