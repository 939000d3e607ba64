"""Separate network hosts on one machine, for tests of several nodes
(tests/project/test_two_nodes.py).

Each node is a Linux network namespace with its own interface and IPv4 address; a switch (one
more namespace holding a bridge) joins them and the host into one subnet. The switch lives in
its own namespace so that the host's firewall (Docker's FORWARD policy DROP, applied to bridged
traffic by br_netfilter) never sees node-to-node traffic. A process started inside a node
reaches the host's services at ``host_address`` and the other nodes at theirs, and nothing of
the host's loopback: ports of one node never collide with another's.

    with Network("ot123") as net:
        a = net.add_node("a")
        with a.entered():
            subprocess.Popen(...)  # runs on node a
        net.kill(a)                # every process on node a, as a power cut would

Needs root and iproute2's ``ip``; ``problem()`` says why not where they are missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str, netns: str = "") -> None:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def problem() -> str:
    """Why network namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this runs as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    probe = f"otprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as err:
        return f"cannot make a network namespace: {err}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return ""


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Node:
    """One host: its namespace, its interface there and its address on the shared subnet."""

    label: str
    netns: str
    interface: str
    address: str

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block's calling thread inside this node's namespace (a process started in
        it, with its children, lives there for good); back to the previous one after."""
        own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        try:
            _setns(f"/run/netns/{self.netns}")
            yield
        finally:
            try:
                if _libc.setns(own, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "could not return to the test's namespace")
            finally:
                os.close(own)

    def pids(self) -> list[int]:
        done = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=30
        )
        return [int(p) for p in done.stdout.split()]


class Network:
    """A subnet 10.231.<n>.0/24 with the host at .1 and nodes from .2; every namespace and
    link it made is removed on exit, whatever happened (its processes are killed first)."""

    def __init__(self, prefix: str, subnet: int | None = None) -> None:
        self.prefix = prefix[:8]  # interface names are at most 15 characters
        self.subnet = subnet if subnet is not None else 20 + os.getpid() % 200
        self.switch = f"{self.prefix}sw"
        self.host_link = f"{self.prefix}h"
        self.host_address = f"10.231.{self.subnet}.1"
        self.nodes: list[Node] = []
        self._made: list[str] = []  # namespaces, removed in reverse

    def __enter__(self) -> Network:
        try:
            self._netns(self.switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            self._cable(self.host_link, "host")
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.host_link)
            _ip("link", "set", self.host_link, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)  # stale
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("link", "set", "lo", "up", netns=name)

    def _cable(self, end: str, port: str) -> None:
        """A veth pair: ``end`` here, ``port`` plugged into the switch's bridge."""
        _ip("link", "add", end, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("link", "set", port, "master", "br0", "up", netns=self.switch)

    def add_node(self, label: str) -> Node:
        """A new host on the subnet, with the next address."""
        netns = f"{self.prefix}{label}"
        address = f"10.231.{self.subnet}.{len(self.nodes) + 2}"
        self._netns(netns)
        interface = f"{self.prefix}{label}"
        self._cable(interface, f"p{label}")
        _ip("link", "set", interface, "netns", netns)
        _ip("addr", "add", f"{address}/24", "dev", interface, netns=netns)
        _ip("link", "set", interface, "up", netns=netns)
        node = Node(label, netns, interface, address)
        self.nodes.append(node)
        return node

    def kill(self, node: Node) -> list[int]:
        """SIGKILL every process on ``node`` (its agent and every job process), as a node that
        lost power; its processes are gone when this returns. The pids killed."""
        killed = node.pids()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in killed):
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes of node {node.label} outlived SIGKILL")
            time.sleep(0.05)
        return killed

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                self.kill(node)
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.host_link], capture_output=True, timeout=30)
        self._made.clear()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True
