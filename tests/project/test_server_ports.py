"""A port belongs to one server. gRPC turns SO_REUSEPORT on by default, so a second server
bound to a port one of ours held shared it silently and the kernel split the connections
between them. A CI run caught it: EnvHub, started on a port the local mesh had picked for it,
found one of its own built-in env servers already there (drawn as "any free port" just
before), and a rollout's episode stream that reached the env server failed "INTERNAL:
Internal error from Core". Now the second bind fails naming the port
(opentinker/grpc_options.py), and EnvHub holds its port before its built-in env servers take
theirs (services/envhub/server.py ``bind_envhub``). Nor does the local mesh pick its services'
ports in advance any more: each binds port 0 and says which it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from opentinker.env_server import serve
from opentinker.services.common.grpc_server import aio_channel, create_aio_server
from opentinker.services.envhub import server as envhub_server
from opentinker.services.envhub.builtin_envs import BUILTIN_GAMES
from opentinker.services.envhub.server import EnvHubDeps, bind_envhub, start_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.launcher import mesh as mesh_module
from opentinker.services.launcher import processes, redis_process
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.launcher.redis_process import RedisProcess

pytestmark = pytest.mark.integration


def test_a_server_on_a_port_an_env_server_holds_fails_naming_it() -> None:
    """The collision as it happened: an env server on port 0 draws P, then EnvHub binds P."""
    handle = serve(BUILTIN_GAMES["letter"], port=0, block=False)
    try:
        port = int(handle.address.rpartition(":")[2])

        async def main() -> None:
            with pytest.raises(
                OSError,
                match=f"could not bind a gRPC server to 127.0.0.1:{port}: the port is taken",
            ):
                create_aio_server(["x.v1.X"], host="127.0.0.1", port=port)
            with pytest.raises(OSError, match="could not bind"):
                await bind_envhub(EnvHubSettings(host="127.0.0.1", port=port))

        asyncio.run(main())
        # And the other way round: an env server on a port an aio server holds.
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            serve(BUILTIN_GAMES["letter"], port=port, block=False)
    finally:
        handle.stop(0)


def test_envhub_that_cannot_bind_closes_its_channel_to_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The channel bind_envhub opens for its credential checks is closed again when the port
    is taken, not left open for the caller, who never gets it."""
    opened: list[grpc.aio.Channel] = []

    def recorded(address: str, **options: str) -> grpc.aio.Channel:
        channel = aio_channel(address, **options)
        opened.append(channel)
        return channel

    monkeypatch.setattr(envhub_server, "aio_channel", recorded)

    async def main() -> None:
        server, port, _ = create_aio_server(["x.v1.X"], host="127.0.0.1", port=0)
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                await bind_envhub(EnvHubSettings(host="127.0.0.1", port=port))
        finally:
            await server.stop(0)
        assert len(opened) == 1
        assert opened[0].get_state() == grpc.ChannelConnectivity.SHUTDOWN

    asyncio.run(main())


def test_envhub_holds_its_port_before_its_built_in_env_servers_take_theirs(
    identities,  # noqa: ANN001 - the scheduler that checks credentials (conftest)
) -> None:
    async def main() -> None:
        settings = EnvHubSettings(
            host="127.0.0.1",
            port=0,
            builtin_envs=["letter", "bandit", "math", "gomoku"],
            scheduler_address=identities.scheduler_address,
        )
        bound = await bind_envhub(settings)
        # Held from here on: nothing else of ours can bind it, the env servers included.
        with pytest.raises(OSError, match=f"127.0.0.1:{bound.port}"):
            create_aio_server(["x.v1.X"], host="127.0.0.1", port=bound.port)
        deps = EnvHubDeps.create(settings)
        server, port = await start_envhub(bound, settings, deps)
        try:
            assert port == bound.port
            assert bound.port not in {int(h.address.rpartition(":")[2]) for h in deps.builtins}
            assert len(deps.builtins) == 4
        finally:
            await server.stop(0)
            await deps.close()

    asyncio.run(main())


def test_the_mesh_picks_no_port_for_its_services_in_advance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mesh picked a free port for the scheduler, EnvHub and the dashboard, then started
    them on it; another process could take it in between (here every pick returns a port held
    by this test) and the service failed to start. Now each binds port 0 and writes the port
    it got to its address file; a restart takes the same port again."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        for module in (mesh_module, processes):  # wherever the mesh would look the name up
            monkeypatch.setattr(module, "free_port", lambda host="127.0.0.1": taken, raising=False)
        run_root = tmp_path / "mesh"
        settings = MeshSettings(run_root=run_root, warm_spares=0, dashboard_port=0)
        with LocalMesh(settings) as mesh:
            dashboard = mesh.dashboard_url.removeprefix("http://").rstrip("/")
            addresses = [mesh.scheduler_address, mesh.envhub_address, dashboard]
            ports = {int(address.rpartition(":")[2]) for address in addresses}
            assert taken not in ports and len(ports) == 3, addresses
            assert (run_root / "scheduler.addr").read_text() == mesh.scheduler_address
            assert (run_root / "envhub.addr").read_text() == mesh.envhub_address
            assert (run_root / "dashboard.addr").read_text() == dashboard
            mesh.kill("scheduler")
            mesh.restart("scheduler")  # waits until SERVING at the address it had
            assert (run_root / "scheduler.addr").read_text() == mesh.scheduler_address


def test_a_redis_whose_picked_port_another_redis_took_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-server cannot bind port 0 and say which it got, so RedisProcess picks a port
    first. Another Redis taking it in between answered the readiness PING instead: the start
    "succeeded" on the other server (another test's data). Now the server that answers must
    be ours (its pid), and a picked port lost to another Redis is picked again."""
    with RedisProcess(tmp_path / "first") as first:
        picks = iter([first.port])
        real_pick = redis_process.free_port
        monkeypatch.setattr(
            redis_process,
            "free_port",
            lambda host="127.0.0.1": next(picks, None) or real_pick(host),
        )
        with RedisProcess(tmp_path / "second") as second:
            assert second.port != first.port
            pid = redis_process._server_pid("127.0.0.1", second.port, timeout_s=1.0)
            assert pid == second._process.pid  # noqa: SLF001 - the server that answers is ours
        given = RedisProcess(tmp_path / "third", port=first.port)  # a port given: no retry
        with pytest.raises(RuntimeError, match="another Redis \\(pid \\d+\\) holds it"):
            given.start()


def test_a_port_held_by_something_that_talks_without_end_is_not_redis() -> None:
    """What answers on a picked port is asked for its pid (INFO server); a server that sends
    without end is read up to a bound and is not taken for Redis, rather than read forever."""
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]

        def chatter() -> None:
            connection, _ = listening.accept()
            with connection, contextlib.suppress(OSError):
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    connection.sendall(b"x" * 4096)

        thread = threading.Thread(target=chatter, daemon=True)
        thread.start()
        started = time.monotonic()
        assert redis_process._server_pid("127.0.0.1", port, timeout_s=1.0) is None
        assert time.monotonic() - started < 5
        thread.join(timeout=15)


def test_a_mesh_on_an_ipv6_host_says_addresses_a_channel_and_a_browser_can_use(
    tmp_path: Path,
) -> None:
    """Services on host ``::1`` wrote ``::1:PORT`` to their address files (and the dashboard's
    URL read ``http://::1:PORT/``): a gRPC target and a URL need the address in brackets."""
    settings = MeshSettings(run_root=tmp_path / "mesh", host="::1", warm_spares=0, dashboard_port=0)
    with LocalMesh(settings) as mesh:  # waits until each serves at the address it said
        for address in (mesh.scheduler_address, mesh.envhub_address):
            assert address.startswith("[::1]:"), address
            with grpc.insecure_channel(address) as channel:
                grpc.channel_ready_future(channel).result(timeout=10)
        assert mesh.dashboard_url.startswith("http://[::1]:"), mesh.dashboard_url


def test_the_mesh_gives_its_redis_the_startup_timeout(tmp_path: Path) -> None:
    """MeshSettings.startup_timeout_s reaches the embedded Redis too (it had a fixed 10 s: a
    Redis loading a large append-only file on a restarted run root failed the mesh's start)."""
    with (
        pytest.raises(TimeoutError, match=r"did not answer PING within 0\.001 s"),
        LocalMesh(MeshSettings(run_root=tmp_path, startup_timeout_s=0.001)),
    ):
        pass
