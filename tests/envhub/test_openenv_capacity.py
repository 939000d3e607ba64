"""The OpenEnv adapter and its server's session limit (issue 34): an OpenEnv server holds
max_concurrent_envs sessions (1 unless its app says more), while the adapter offered EnvHub
64 episodes and 7 of 8 failed with nothing naming the setting. The adapter now discovers the
limit when not told, and a refusal names ``--capacity``. Real OpenEnv servers
(openenv_servers.py) under uvicorn."""

from __future__ import annotations

import pytest
from openenv.core.env_server import create_app
from openenv_servers import APPS, EchoAction, EchoEnvironment, EchoObservation, openenv_server

from opentinker.errors import ResourceExhaustedError
from opentinker.services.envhub.adapters.openenv_adapter import parse_args
from opentinker.services.envhub.adapters.openenv_session import OpenEnvSession, discover_capacity

pytestmark = pytest.mark.integration

APPS["echo-2"] = lambda: create_app(EchoEnvironment, EchoAction, EchoObservation, "echo", 2)


def test_the_adapter_discovers_the_servers_session_limit() -> None:
    with openenv_server("echo-2") as url:
        assert discover_capacity(url, upto=64, timeout_s=5) == 2
        assert discover_capacity(url, upto=1, timeout_s=5) == 1  # never more than offered
        # every probe session was closed: the server takes two again
        sessions = [OpenEnvSession(url, timeout_s=5) for _ in range(2)]
        try:
            for s in sessions:
                s.reset({})
        finally:
            for s in sessions:
                s.close()


def test_a_capacity_refusal_names_the_setting_to_change() -> None:
    with openenv_server("echo-2") as url:
        sessions = [OpenEnvSession(url, timeout_s=5) for _ in range(3)]
        try:
            sessions[0].reset({})
            sessions[1].reset({})
            with pytest.raises(ResourceExhaustedError) as refused:
                sessions[2].reset({})
        finally:
            for s in sessions:
                s.close()
    message = str(refused.value)
    assert "CAPACITY_REACHED" in message and "at most 2 sessions" in message
    assert "--capacity 2" in message and "max_concurrent_envs" in message


def test_capacity_is_discovered_unless_told() -> None:
    assert parse_args(["--url", "http://x"]).capacity is None  # discovered at start
    assert parse_args(["--url", "http://x", "--capacity", "1"]).capacity == 1
