"""Real OpenEnv servers (openenv's own ``create_app`` under uvicorn) for the adapter's tests.

- ``echo``: OpenEnv's echo env (envs/echo_env in meta-pytorch/OpenEnv), rebuilt here because
  the PyPI package ships only the framework: the action is ``{"message": str}``, the
  observation echoes it with its length, the reward is 0.1 per character. One addition for
  the tests: the message ``bye`` ends the episode.
- ``counter``: a multi-field action (``{"delta": int, "note": str}``) the model writes as JSON;
  the episode ends when the total reaches the target the reset's ``target`` option sets;
  a negative delta raises inside the env.
- ``calc``: an MCP env (OpenEnv's ``MCPEnvironment``) with FastMCP tools ``add`` and
  ``shout``; ``shout("crash")`` raises inside the env.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str
    message_length: int = 0


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any):
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return EchoObservation(echoed_message="Echo environment ready!", reward=0.0)

    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any):
        self._state.step_count += 1
        message = action.message
        return EchoObservation(
            echoed_message=message,
            message_length=len(message),
            reward=len(message) * 0.1,
            done=message == "bye",
        )

    @property
    def state(self) -> State:
        return self._state


class CountAction(Action):
    delta: int
    note: str = ""


class CountObservation(Observation):
    total: int
    target: int


class CounterEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.total, self.target = 0, 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, target: int = 5):
        self.total, self.target = 0, int(target)
        return CountObservation(total=0, target=self.target)

    def step(self, action: CountAction, timeout_s: float | None = None, **kwargs: Any):
        if action.delta < 0:
            raise ValueError("no going back")
        self.total += action.delta
        done = self.total >= self.target
        return CountObservation(
            total=self.total, target=self.target, done=done, reward=1.0 if done else None
        )

    @property
    def state(self) -> State:
        return self._state


class ReadyObservation(Observation):
    message: str


def _calc_tools() -> FastMCP:
    mcp = FastMCP("calc")

    @mcp.tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @mcp.tool
    def shout(text: str) -> str:
        """Upper-case a text."""
        if text == "crash":
            raise RuntimeError("the shouting tool broke")
        return text.upper()

    return mcp


class CalcEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__(_calc_tools())
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any):
        return ReadyObservation(message="Use the tools to compute 2 + 3.", reward=0.0)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any):
        raise ValueError("calc takes MCP tool calls only")

    @property
    def state(self) -> State:
        return self._state


APPS = {
    "echo": lambda: create_app(EchoEnvironment, EchoAction, EchoObservation, "echo", 8),
    "counter": lambda: create_app(CounterEnvironment, CountAction, CountObservation, "ctr", 8),
    "calc": lambda: create_app(CalcEnvironment, CallToolAction, CallToolObservation, "calc", 8),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def openenv_server(kind: str) -> Iterator[str]:
    """Serve one of ``APPS`` with uvicorn on a free port; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(APPS[kind](), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"openenv-{kind}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server died"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
