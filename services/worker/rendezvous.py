"""The environment a worker's part of a multi-worker job runs with (LaunchJob.rendezvous).

torchrun's names, so a rank launcher maps them one to one: ``torchrun --nnodes $NNODES
--node_rank $NODE_RANK --nproc_per_node <devices leased here> --master_addr $MASTER_ADDR
--master_port $MASTER_PORT`` (ranks are numbered node by node, so this worker's local rank i is
global rank RANK_START + i); or, without torchrun, ``init_process_group(init_method=
f"tcp://{MASTER_ADDR}:{MASTER_PORT}", rank=RANK_START + i, world_size=WORLD_SIZE)``.

Gloo's ranks bind the address this host's name resolves to, and tell it to the other ranks:
on a host whose name resolves to a loopback address (Debian's 127.0.1.1, a container's
127.0.0.1) the ranks of other nodes are told 127.x and cannot connect. So a part is also given
GLOO_SOCKET_IFNAME, the interface holding this worker's rendezvous address (the one the other
nodes reach it at), unless the operator set GLOO_SOCKET_IFNAME themselves.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct

from opentinker.scheduler.v1 import scheduler_pb2

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


def interface_of(host: str) -> str:
    """The name of this machine's network interface holding ``host``'s IPv4 address (an
    address or a name resolved here); "" when none does (or on a system without the ioctl)."""
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # an interface without an IPv4 address
                packed = fcntl.ioctl(
                    sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode())
                )
                if socket.inet_ntoa(packed[20:24]) in wanted:
                    return name
    return ""


def rendezvous_env(launch: scheduler_pb2.LaunchJob, *, local_host: str = "") -> dict[str, str]:
    """MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NNODES, NODE_RANK, RANK_START, LOCAL_WORLD_SIZE
    for a part of a multi-worker job, and GLOO_SOCKET_IFNAME (the interface of ``local_host``,
    this worker's rendezvous address) when the environment does not set it; {} for a
    one-worker job."""
    if not launch.HasField("rendezvous"):
        return {}
    r = launch.rendezvous
    interface = "" if os.environ.get("GLOO_SOCKET_IFNAME") else interface_of(local_host)
    return {
        **({"GLOO_SOCKET_IFNAME": interface} if local_host and interface else {}),
        "MASTER_ADDR": r.master_addr,
        "MASTER_PORT": str(r.master_port),
        "WORLD_SIZE": str(r.world_size),
        "NNODES": str(r.num_nodes),
        "NODE_RANK": str(r.node_rank),
        "RANK_START": str(r.rank_start),
        "LOCAL_WORLD_SIZE": str(len(launch.device_ids)),
    }
