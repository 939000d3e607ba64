"""A rank whose process group breaks under it (another rank, or its node, lost) ends its
attempt to be re-queued (exit_codes.RETRY_LATER), not the job failed: trainer/distributed's
``group_broke`` tells that from the job's own errors. The real case: a gloo group whose other
rank dies; tests/project/test_two_nodes.py shows the whole path (a node lost mid-job, the job
resumed), which failed the job without it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from opentinker.services.trainer.parallel.distributed import group_broke

pytestmark = pytest.mark.integration

PART = Path(__file__).parents[1] / "support" / "gloo_peer_lost_part.py"


def test_what_counts_as_the_group_breaking() -> None:
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[10.231.9.2]:40848: Connection reset by peer"
    )
    assert group_broke(gloo)
    assert group_broke(dist.DistNetworkError("connect() timed out"))
    assert group_broke(dist.DistBackendError("NCCL watchdog: collective timed out"))
    # the job's own faults fail it as before
    assert not group_broke(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3, 4x5)"))
    assert not group_broke(ValueError("learning_rate must be positive"))


def test_a_dead_peer_breaks_a_real_gloo_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [
        subprocess.Popen(
            [sys.executable, str(PART), str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].wait(timeout=30)
    assert ranks[0].returncode == 0, err[-2000:]
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["type"] != "none", "rank 0's collectives went on without rank 1"
    assert seen["group_broke"], seen
