"""gRPC limits and keepalives that every server of ours uses: the services' and the SDK's
environment servers alike (this module imports nothing, so the SDK can hold it).

A server pings a silent client every ``keepalive_s`` and drops the connection when a ping
is not answered within ``ping_timeout_s``; its calls then end as cancelled, so whatever they
held is let go (an EnvHub stream's episodes, an env server's games). Without it a client
host that vanished without closing (powered off, stopped, cut off) held them until gRPC's
default of two hours. Both numbers are needed: gRPC times a keepalive ping out by
``grpc.http2.ping_timeout_ms`` (default 60 s), and sends none more often than
``grpc.http2.min_sent_ping_interval_without_data_ms`` (default 5 min) while no data flows.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_KEEPALIVE_S = 20.0
SERVER_PING_TIMEOUT_S = 10.0


def server_options(
    keepalive_s: float = SERVER_KEEPALIVE_S, ping_timeout_s: float = SERVER_PING_TIMEOUT_S
) -> list[tuple[str, int]]:
    """Options for ``grpc.server``/``grpc.aio.server``: 64 MiB messages, clients' own
    keepalive pings allowed (every 5 s at most), and the server's (module docstring)."""
    keepalive_ms, timeout_ms = int(keepalive_s * 1000), int(ping_timeout_s * 1000)
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.min_sent_ping_interval_without_data_ms", keepalive_ms),
    ]
