"""A worker token admits exactly one worker identity (issue 37).

Found from outside: the bootstrap worker token, valid for any worker id, let a rogue process
holding it register as a worker of its own; it received another job's launch (its spec and job
token) and burned 2 of that job's 3 attempts. Real scheduler (gRPC + Redis, its real bootstrap
folder), scripted workers on real streams and the real worker agent.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from async_guard import run
from scheduler_helpers import (
    RPC_TIMEOUT_S,
    Mesh,
    ScriptedWorker,
    scheduler_mesh,
    scripted_worker,
    stub_with,
    submit,
)

from opentinker.errors import REASON_METADATA_KEY
from opentinker.services.worker.agent import WorkerAgent
from opentinker.services.worker.devices import detect_devices
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.worker_id import with_stable_worker_id

pytestmark = pytest.mark.integration


def bootstrap_token(tmp_path: Path) -> str:
    return (tmp_path / "secrets" / "worker.token").read_text().strip()


async def refused(mesh: Mesh, token: str, worker_id: str) -> grpc.aio.AioRpcError:
    """The error a registration of ``worker_id`` with ``token`` ends in (it must end in one)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async with scripted_worker(stub_with(mesh, token), worker_id, [f"{worker_id}/cpu:0"]):
            pass
    return info.value


def rogue_beside_the_real_worker(
    redis_url: str, tmp_path: Path, rogue_id: str
) -> grpc.aio.AioRpcError:
    """The real worker "node-a" registers with the bootstrap token (binding it); a rogue
    holding the same file registers as ``rogue_id`` and must be refused (its error returned);
    the real worker stays the only one and gets the next job's launch, attempt 1."""
    errors: list[grpc.aio.AioRpcError] = []

    async def main() -> None:
        async with scheduler_mesh(
            redis_url, lease_ttl_s=30.0, bootstrap_dir=tmp_path / "secrets"
        ) as mesh:
            token = bootstrap_token(tmp_path)
            async with scripted_worker(stub_with(mesh, token), "node-a", ["node-a/cpu:0"]) as a:
                errors.append(await refused(mesh, token, rogue_id))
                identity = mesh.running.stores.identity  # the binding, as listings show it
                assert (await identity.authenticate(token)).worker_id == "node-a"
                keys = (await identity.list_api_keys()).items
                (info,) = [i for i in keys if i.key_prefix == token.split("_")[1]]
                assert info.worker_id == "node-a"
                assert mesh.running.scheduler.connected_workers() == ["node-a"]
                job = await submit(mesh.stub, "victim")
                launch = (await a.next_command()).launch
                assert (launch.job.job_id, launch.job.attempt) == (job.job_id, 1)

    run(main)
    return errors[0]


def test_a_rogue_with_the_bootstrap_token_cannot_register_as_another_worker(
    redis_url: str, tmp_path: Path
) -> None:
    """The real worker registers first with the bootstrap token (binding it); a rogue holding
    the same file is refused under any other id, naming the fix, and is never sent a launch:
    the job goes to the real worker, on its first attempt."""
    error = rogue_beside_the_real_worker(redis_url, tmp_path, "rogue")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error
    assert "create-worker-token --worker-id rogue" in (error.details() or "")
    assert (REASON_METADATA_KEY, "WRONG_WORKER") in tuple(error.trailing_metadata())


def test_a_second_live_stream_under_the_same_worker_id_is_refused(
    redis_url: str, tmp_path: Path
) -> None:
    """A rogue holding the bound token takes the real worker's own id while that worker is
    connected and heartbeating: refused (before: it replaced the worker's stream and got its
    launches); the real worker keeps its stream and gets the next launch."""
    error = rogue_beside_the_real_worker(redis_url, tmp_path, "node-a")
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS, error
    assert (REASON_METADATA_KEY, "WORKER_ID_IN_USE") in tuple(error.trailing_metadata())


def test_a_worker_whose_stream_dropped_registers_again_at_once(
    redis_url: str, tmp_path: Path
) -> None:
    """The same worker id, its old stream gone (killed agent, dropped connection), is
    admitted again with the token it bound, without waiting for a lease TTL."""

    async def main() -> None:
        async with scheduler_mesh(
            redis_url, lease_ttl_s=30.0, bootstrap_dir=tmp_path / "secrets"
        ) as mesh:
            token = bootstrap_token(tmp_path)
            first = ScriptedWorker(stub_with(mesh, token), "node-a", ["node-a/cpu:0"])
            await first.connect()
            await first.disconnect()  # no `closing`: as a SIGKILL leaves it
            async with scripted_worker(stub_with(mesh, token), "node-a", ["node-a/cpu:0"]) as a:
                job = await submit(mesh.stub, "after-restart")
                assert (await a.next_command()).launch.job.job_id == job.job_id
            # A silent old stream (no heartbeat, not ended) is taken over after 2 heartbeats.
            silent = ScriptedWorker(stub_with(mesh, token), "node-a", ["node-a/cpu:0"])
            await silent.connect()
            silent.heartbeating = False
            await asyncio.sleep(0.3)
            async with scripted_worker(stub_with(mesh, token), "node-a", ["node-a/cpu:0"]):
                assert mesh.running.scheduler.connected_workers() == ["node-a"]
            await silent.disconnect()

    run(main)


def test_the_worker_agent_keeps_its_default_id_across_restarts_and_is_admitted(
    redis_url: str, tmp_path: Path
) -> None:
    """The agent's default id was <hostname>-<pid>: new at every start, so the bootstrap token
    its first run bound would refuse the restarted agent. Now the default is kept in its run
    root, and the restarted agent (a new WorkerSettings, as a new process reads) registers."""

    async def start_and_stop(mesh: Mesh, token_file: Path) -> str:
        settings = with_stable_worker_id(
            WorkerSettings(
                scheduler_address=mesh.running.address,
                worker_token_file=token_file,
                run_root=tmp_path / "runs",
                devices=["cpu:0"],
                warm_spares=0,
                connect_timeout_s=3,
            )
        )
        agent = WorkerAgent(settings, detect_devices(settings))
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await asyncio.wait_for(agent.connected.wait(), RPC_TIMEOUT_S)
            assert mesh.running.scheduler.connected_workers() == [settings.worker_id]
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
        return settings.worker_id

    async def main() -> None:
        async with scheduler_mesh(
            redis_url, lease_ttl_s=30.0, bootstrap_dir=tmp_path / "secrets"
        ) as mesh:
            token_file = tmp_path / "secrets" / "worker.token"
            first = await start_and_stop(mesh, token_file)
            assert await start_and_stop(mesh, token_file) == first
            assert (tmp_path / "runs" / "worker.id").read_text().strip() == first

    run(main, 60)
