"""A job's trainer ranks on this worker: one process per leased device, started with the
standard torch.distributed environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), supervised as one unit.

Not torchrun: a job spanning workers may hold a different number of devices on each
(rendezvous.py's RANK_START), which torchrun's rank numbering (node_rank x nproc_per_node)
cannot express. The ranks meet through ``init_process_group``'s env:// rendezvous; rank 0
drives the job and the others follow it (trainer/parallel/ranks.py).

A one-worker job gets MASTER_ADDR 127.0.0.1 and a free port of this machine; a job spanning
workers gets the scheduler's rendezvous (rendezvous.py), and only the worker holding rank 0
starts the rollout.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from opentinker.services.worker.supervisor import ManagedProcess

# rendezvous.py's names: they go to the trainer ranks only, not to the rollout.
RENDEZVOUS_KEYS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "NNODES",
    "NODE_RANK",
    "RANK_START",
    "LOCAL_WORLD_SIZE",
)
RANK_ENV_KEYS = (*RENDEZVOUS_KEYS, "RANK", "LOCAL_RANK")  # every variable a rank is given


def rank_envs(num_local: int, rendezvous: dict[str, str]) -> list[dict[str, str]]:
    """The environment of each of this worker's ``num_local`` ranks, local rank 0 first.
    ``rendezvous``: a multi-worker job's (rendezvous_env); {} for a one-worker job."""
    if rendezvous:
        base = {k: rendezvous[k] for k in RENDEZVOUS_KEYS}
    else:
        base = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(num_local),
            "NNODES": "1",
            "NODE_RANK": "0",
            "RANK_START": "0",
            "LOCAL_WORLD_SIZE": str(num_local),
        }
    start = int(base["RANK_START"])
    return [{**base, "RANK": str(start + i), "LOCAL_RANK": str(i)} for i in range(num_local)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankGroup:
    """This worker's ranks of one job, waited on and stopped as one process would be
    (what JobRun's supervision uses of a ManagedProcess).

    ``wait`` returns when every rank has exited 0, or as soon as one exits otherwise: that
    rank's code is the group's, and ``log_path``/``name`` point at it, so the attempt's reason
    names the rank that failed. The caller then ``terminate``s the rest."""

    def __init__(self, ranks: list[ManagedProcess]) -> None:
        if not ranks:
            raise ValueError("a rank group needs at least one rank")
        self.ranks = ranks
        self._failed: ManagedProcess | None = None

    @property
    def name(self) -> str:
        culprit = self._failed or self.ranks[0]
        return culprit.name

    @property
    def log_path(self) -> Path:
        return (self._failed or self.ranks[0]).log_path

    @property
    def pid(self) -> int:
        return self.ranks[0].pid

    @property
    def returncode(self) -> int | None:
        if self._failed is not None:
            return self._failed.returncode
        if all(r.returncode is not None for r in self.ranks):
            return self.ranks[0].returncode
        return None

    @property
    def running(self) -> bool:
        return self.returncode is None

    async def wait(self) -> int:
        waits = {asyncio.create_task(r.wait()): r for r in self.ranks}
        pending = set(waits)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.result() != 0 and self._failed is None:
                        self._failed = waits[task]
                if self._failed is not None:
                    break
        finally:
            for task in pending:
                task.cancel()
        code = self.returncode
        assert code is not None
        return code

    async def terminate(self, grace_s: float) -> int:
        codes = await asyncio.gather(*(r.terminate(grace_s) for r in self.ranks))
        failed = self._failed.returncode if self._failed is not None else None
        return codes[0] if failed is None else failed
