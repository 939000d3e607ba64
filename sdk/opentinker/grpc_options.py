"""gRPC limits and keepalives of every server and channel of ours: the services', the SDK's
clients and its environment servers alike (this module imports nothing, so the SDK holds it);
and ``host_port``, how each of them writes an address.

Each side pings a silent peer every ``keepalive_s`` (servers 20 s, channels 10 s) and drops
the connection when a ping is not answered within half of that; the calls on it then end (a
server's as cancelled, a client's UNAVAILABLE), so whatever they held is let go (an EnvHub
stream's episodes, an env server's games) and a caller waiting on a peer that vanished
(powered off, stopped, cut off) hears of it. Without this a server noticed after gRPC's
default of two hours, and a client only after more than a minute. Three settings are needed:
gRPC times a keepalive ping out by ``grpc.http2.ping_timeout_ms`` (default 60 s, not
``keepalive_timeout_ms``), and sends none more often than
``grpc.http2.min_sent_ping_interval_without_data_ms`` (default 5 min) while no data flows.
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_KEEPALIVE_S = 20.0
CHANNEL_KEEPALIVE_S = 10.0  # at least the servers' min_ping_interval_without_data (5 s)


def _keepalive(keepalive_s: float) -> list[tuple[str, int]]:
    """A ping every ``keepalive_s`` while the peer is silent, answered within half of it."""
    keepalive_ms, timeout_ms = int(keepalive_s * 1000), int(keepalive_s * 500)
    return [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.min_sent_ping_interval_without_data_ms", keepalive_ms),
    ]


def server_options(keepalive_s: float = SERVER_KEEPALIVE_S) -> list[tuple[str, int]]:
    """Options for ``grpc.server``/``grpc.aio.server``: 64 MiB messages, clients' own
    keepalive pings allowed (every 5 s at most), and the server's (module docstring).

    No SO_REUSEPORT (gRPC sets it by default on Linux): with it, a server bound to a port
    another of our servers holds shares it silently, and the kernel splits the connections
    between the two (seen: EnvHub on a port one of its built-in env servers had drawn, so a
    rollout's episode stream reached the env server and failed INTERNAL). Without it the
    second bind fails, naming the port."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        *_keepalive(keepalive_s),
    ]


def channel_options(keepalive_s: float = CHANNEL_KEEPALIVE_S) -> list[tuple[str, int]]:
    """Options for a channel: 64 MiB messages and its keepalive (module docstring)."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        *_keepalive(keepalive_s),
    ]


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC targets and URLs write it: a bare IPv6 address in brackets
    (``[::1]:50051``), where ``::1:50051`` would read as an address with no port."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind(server: Any, address: str, credentials: Any = None, *, what: str = "a gRPC server") -> int:
    """Bind ``server`` (sync or asyncio) to host:port, TLS when ``credentials``; the port bound.
    OSError naming the address when it cannot be had (taken: see server_options), where gRPC
    returns 0 or raises RuntimeError depending on its version."""
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(
            f"could not bind {what} to {address}: the port is taken, or the host is not an "
            "address of this machine"
        )
    return int(bound)
