"""The SDK's watch across scheduler restarts: each outage gets its own reconnect budget."""

from __future__ import annotations

import asyncio
import threading

import pytest
from async_guard import run
from identity_helpers import api_key
from scheduler_helpers import RPC_TIMEOUT_S, scheduler_mesh, submit

import opentinker
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.launcher.processes import free_port

pytestmark = pytest.mark.integration


def test_a_second_restart_long_after_the_first_is_ridden_out_too(redis_url: str) -> None:
    """A queued job sends no events for hours; a watch that rode out one restart must ride
    out the next one too, however long ago the first was (reconnect_for counts one outage)."""
    port = free_port()
    seen: list[opentinker.JobEvent] = []
    failed: list[BaseException] = []

    def follow(key: str, job_id: str) -> None:
        try:
            with opentinker.Client(f"127.0.0.1:{port}", api_key=key) as client:
                seen.extend(client.watch(job_id, reconnect_for=3.0))
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            failed.append(err)

    async def main() -> None:
        async with scheduler_mesh(redis_url, port=port) as first:
            job = await submit(first.stub, "quiet")
            key = await api_key(first.running.stores.identity)
            watcher = threading.Thread(target=follow, args=(key, job.job_id))
            watcher.start()
            await asyncio.sleep(1.0)
        await asyncio.sleep(1.0)  # outage 1: 1 s
        async with scheduler_mesh(redis_url, port=port):
            await asyncio.sleep(4.0)  # connected and quiet, longer than reconnect_for
        await asyncio.sleep(1.0)  # outage 2: 1 s
        async with scheduler_mesh(redis_url, port=port) as third:
            await asyncio.sleep(1.5)
            await third.stub.CancelJob(
                scheduler_pb2.CancelJobRequest(job_id=job.job_id, reason="seen"),
                timeout=RPC_TIMEOUT_S,
            )
            await asyncio.to_thread(watcher.join, 30)
        assert not failed, failed
        assert [(e.seq, e.state) for e in seen] == [(1, "QUEUED"), (2, "CANCELLED")]

    run(main, timeout_s=90)
