"""Jobs spanning workers: one all-or-none lease over several workers, one rendezvous, one unit
on faults. Real Redis, a real scheduler over gRPC, two worker agents (real ConnectWorker
clients on 127.0.0.1 and 127.0.0.2) whose parts meet in a real torch.distributed gloo group."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from async_guard import run
from ledger_helpers import assert_no_double_lease
from scheduler_helpers import (
    ALLOCATING,
    FAILED,
    QUEUED,
    RUNNING,
    ScriptedWorker,
    get_job,
    scheduler_mesh,
    submit,
    wait_for_state,
)

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.scheduler.leases.lease_ledger import RedisLeaseLedger
from opentinker.services.scheduler.placement.spanning import split_across
from opentinker.services.scheduler.placement.worker_session import WorkerSession
from opentinker.services.worker.rendezvous import rendezvous_env

pytestmark = pytest.mark.integration

PART = Path(__file__).parents[1] / "support" / "gloo_rendezvous_part.py"


def test_split_takes_the_fewest_workers_most_free_first() -> None:
    a, b, c = (WorkerSession(w, w, ()) for w in "abc")
    # 5 devices from free a=2, b=4, c=3: b's 4 (most free), then 1 of c's 3 -> two workers.
    assert split_across(5, [(a, 2), (b, 4), (c, 3)]) == [(b, 4), (c, 1)]
    assert split_across(10, [(a, 2), (b, 4), (c, 3)]) is None  # 9 free < 10
    assert split_across(3, [(a, 0), (b, 4)]) is None  # fits on one worker: not a span


def test_group_lease_is_all_or_none_under_contention(redis_url: str) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        ledger = RedisLeaseLedger(client, lease_ttl_s=10.0)
        try:
            await ledger.register_worker("a", ["a/0", "a/1"])
            await ledger.register_worker("b", ["b/0", "b/1"])
            for round_ in range(20):  # the big job and a 1-device job race for b's devices
                big, small = await asyncio.gather(
                    ledger.acquire_group("big", [("a", 2), ("b", 2)], (30000, 2)),
                    ledger.acquire("b", "small", 1),
                )
                held = {d for lease in await ledger.leases("a") for d in lease.device_ids}
                held |= {d for lease in await ledger.leases("b") for d in lease.device_ids}
                # Exactly one wins: the big job with all 4 devices, or the small one with 1
                # (and the big job holds nothing at all, not even a's devices).
                assert (big is None) != (small is None), round_
                assert len(held) == (4 if big is not None else 1), (round_, held)
                if big is not None:
                    assert big.port == 30000 and await ledger.group_of(big.leases[1].lease_id)
                for lease in (big.leases if big else ()) + ((small,) if small else ()):
                    await ledger.release(lease.lease_id)
            # A port stays held until rank 0's lease is released; the range bounds the jobs.
            first = await ledger.acquire_group("j1", [("a", 1), ("b", 1)], (30000, 1))
            assert first is not None and first.port == 30000
            assert await ledger.acquire_group("j2", [("a", 1), ("b", 1)], (30000, 1)) is None
            assert await ledger.free_devices("b") == ["b/1"]  # the refused group took nothing
            await ledger.release(first.leases[0].lease_id)
            again = await ledger.acquire_group("j2", [("a", 1), ("b", 1)], (30000, 1))
            assert again is not None and again.port == 30000
        finally:
            await client.aclose()

    run(main)


class LoopbackWorker(ScriptedWorker):
    """A worker agent at its own loopback address offering a rendezvous port range."""

    def __init__(self, stub, worker_id: str, devices: list[str], host: str, ports) -> None:
        super().__init__(stub, worker_id, devices)
        self.host, self.ports = host, ports

    async def connect(self, held=None) -> scheduler_pb2.WorkerRegistered:
        await self.send(
            register=scheduler_pb2.RegisterWorker(
                worker_id=self.worker_id,
                hostname=self.host,
                devices=[scheduler_pb2.Device(device_id=d, kind="cpu") for d in self.devices],
                rendezvous_host=self.host,
                rendezvous_port_base=self.ports[0],
                rendezvous_port_count=self.ports[1],
            )
        )
        first = await asyncio.wait_for(self.call.read(), 5.0)
        assert first.HasField("registered")
        self._heartbeats = asyncio.create_task(self._beat())
        return first.registered


async def run_part(launch: scheduler_pb2.LaunchJob) -> list[dict]:
    """This worker's ranks (one process per leased device) with the env the agent exports."""
    env = {**os.environ, **rendezvous_env(launch)}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(PART),
            env={**env, "LOCAL_RANK": str(i)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        for i in range(len(launch.device_ids))
    ]
    results = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_job_spans_two_workers_meets_in_one_gloo_group_and_is_requeued_whole(
    redis_url: str,
) -> None:
    big_job_ids = []

    async def main() -> None:
        async with scheduler_mesh(redis_url, lease_ttl_s=1.0) as mesh:
            port = free_port()
            a = LoopbackWorker(
                mesh.worker_stub, "wa", ["wa/cpu:0", "wa/cpu:1"], "127.0.0.2", (port, 1)
            )
            b = LoopbackWorker(mesh.worker_stub, "wb", ["wb/cpu:0"], "127.0.0.1", (port, 1))
            await a.connect()
            await b.connect()
            big = await submit(mesh.stub, "big", num_devices=3)  # more than either worker has
            small = await submit(mesh.stub, "small", num_devices=1)
            big_job_ids.append(big.job_id)
            launch_a = (await a.next_command()).launch
            launch_b = (await b.next_command()).launch
            # One attempt, one token, consistent rendezvous; ranks numbered node by node.
            assert launch_a.job.job_id == launch_b.job.job_id == big.job_id
            assert launch_a.job_token == launch_b.job_token
            ra, rb = launch_a.rendezvous, launch_b.rendezvous
            assert (ra.master_addr, ra.master_port) == (rb.master_addr, rb.master_port)
            assert (ra.master_addr, ra.master_port) == ("127.0.0.2", port)  # rank 0's host
            assert (ra.world_size, ra.num_nodes, ra.node_rank, ra.rank_start) == (3, 2, 0, 0)
            assert (rb.world_size, rb.num_nodes, rb.node_rank, rb.rank_start) == (3, 2, 1, 2)
            assert len(launch_a.device_ids) == 2 and len(launch_b.device_ids) == 1
            # Both parts really meet at that address: 0 + 1 + 2 = 3 on every rank.
            parts = await asyncio.gather(run_part(launch_a), run_part(launch_b))
            ranks = [r for part in parts for r in part]
            assert sorted(r["rank"] for r in ranks) == [0, 1, 2]
            assert {r["sum_of_ranks"] for r in ranks} == {3.0}
            for worker in (a, b):
                await worker.send(launched=scheduler_pb2.JobLaunched(job_id=big.job_id, attempt=1))
            running = await wait_for_state(mesh.stub, big.job_id, RUNNING)
            assert list(running.worker_ids) == ["wa", "wb"] and running.worker_id == "wa"
            # The 1-device job finds no device: the big job holds all three.
            assert (await get_job(mesh.stub, small.job_id)).state == QUEUED
            # Worker b dies: the whole attempt goes back, a's part is stopped and freed.
            await b.disconnect()
            requeued = await wait_for_state(mesh.stub, big.job_id, QUEUED, timeout_s=6)
            assert "worker wb lost" in requeued.reason and not requeued.worker_ids
            stop = (await a.next_command()).stop
            assert (stop.job_id, stop.attempt) == (big.job_id, 1)
            # a's devices stay held until its part exited (draining.py), then are free again:
            # the small job gets one (the big one cannot fit now).
            assert (await get_job(mesh.stub, small.job_id)).state == QUEUED
            exited = scheduler_pb2.JobExited(job_id=big.job_id, attempt=1, exit_code=-15)
            await a.send(exited=exited)
            placed = await wait_for_state(mesh.stub, small.job_id, ALLOCATING)
            assert placed.worker_id == "wa"
            assert (await get_job(mesh.stub, big.job_id)).state == QUEUED
            await a.disconnect()

    run(main)
    assert_no_double_lease(redis_url, big_job_ids[0], attempts=2)  # one lease per worker


def test_a_failed_part_ends_the_whole_attempt(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            a = LoopbackWorker(mesh.worker_stub, "wa", ["wa/cpu:0"], "127.0.0.2", (29500, 4))
            b = LoopbackWorker(mesh.worker_stub, "wb", ["wb/cpu:0"], "127.0.0.1", (29500, 4))
            await a.connect()
            await b.connect()
            job = await submit(mesh.stub, "big", num_devices=2)
            for worker in (a, b):
                assert (await worker.next_command()).launch.rendezvous.world_size == 2
                await worker.send(launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=1))
            await wait_for_state(mesh.stub, job.job_id, RUNNING)
            exited = scheduler_pb2.JobExited(job_id=job.job_id, attempt=1, exit_code=1)
            await b.send(exited=exited)  # rank 1's part failed by itself
            failed = await wait_for_state(mesh.stub, job.job_id, FAILED)
            assert "code 1" in failed.reason, failed.reason
            stop = (await a.next_command()).stop  # rank 0's part must not keep running
            assert (stop.job_id, stop.attempt) == (job.job_id, 1)
            ledger = mesh.running.stores.ledger
            [draining] = await ledger.leases("wa")  # held until rank 0's part exited
            assert draining.drain is not None and await ledger.leases("wb") == []
            stopped = scheduler_pb2.JobExited(job_id=job.job_id, attempt=1, exit_code=-15)
            await a.send(exited=stopped)
            await asyncio.sleep(0.3)
            assert await ledger.leases("wa") == []
            await a.disconnect()
            await b.disconnect()

    run(main)


def test_a_bad_rendezvous_port_range_is_refused_naming_the_field(redis_url: str) -> None:
    async def main() -> None:
        async with scheduler_mesh(redis_url) as mesh:
            worker = LoopbackWorker(mesh.worker_stub, "wa", ["wa/cpu:0"], "127.0.0.1", (65000, 900))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker.connect()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "register.rendezvous_port_base/count" in err.value.details()

    run(main)
