"""A spanning job's ranks bind gloo to the interface of their worker's rendezvous address
(worker/rendezvous.py), not to whatever the host's name resolves to: on a host whose name is
127.0.1.1 or 127.0.0.1 in /etc/hosts, gloo would otherwise tell the other nodes' ranks a
loopback address (tests/project/test_two_nodes.py shows the job failing that way without it)."""

from __future__ import annotations

import pytest

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker.services.worker.rendezvous import interface_of, rendezvous_env

pytestmark = pytest.mark.unit


def spanning_launch() -> scheduler_pb2.LaunchJob:
    rendezvous = scheduler_pb2.MultiNodeRendezvous(
        master_addr="10.0.0.2", master_port=29500, world_size=2, num_nodes=2, node_rank=1,
        rank_start=1,
    )  # fmt: skip
    return scheduler_pb2.LaunchJob(device_ids=["b/cpu:0"], rendezvous=rendezvous)


def test_the_interface_holding_an_address_or_none() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("localhost") == "lo"  # a name is resolved first
    assert interface_of("192.0.2.254") == ""  # TEST-NET-1, held by no interface here
    assert interface_of("no-such-host.invalid") == ""


def test_a_spanning_part_binds_gloo_to_its_rendezvous_interface(monkeypatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    env = rendezvous_env(spanning_launch(), local_host="127.0.0.1")
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    assert (env["MASTER_ADDR"], env["RANK_START"], env["WORLD_SIZE"]) == ("10.0.0.2", "1", "2")
    # an address not on this host: gloo's own choice is left alone
    assert "GLOO_SOCKET_IFNAME" not in rendezvous_env(spanning_launch(), local_host="192.0.2.254")
    # a one-worker job has no rendezvous at all
    assert rendezvous_env(scheduler_pb2.LaunchJob(), local_host="127.0.0.1") == {}


def test_the_operators_interface_is_kept(monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")  # passed to the job with the worker's env
    assert "GLOO_SOCKET_IFNAME" not in rendezvous_env(spanning_launch(), local_host="127.0.0.1")
