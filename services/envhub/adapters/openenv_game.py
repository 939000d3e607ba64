"""An OpenEnv server as an OpenTinker environment: one ``OpenEnvGame`` per episode, each on
its own WebSocket session (``openenv_session``), its text mapped by ``openenv_actions``.

Mapping: Reset sends ``{"seed": seed, **env_options}`` (option values that parse as JSON are
sent parsed: ``"3"`` -> 3) and shows the reset observation; Step turns the text into actions,
sends them, and returns their observations as text, their rewards summed (``null`` -> 0) and
``done`` as the server says. An MCP server's episode also ends on a reply with no tool call.
A reply that is no valid action (or that the server's schema validation refuses) is shown to
the model as an error message with reward 0; every other server error is a status code (see
``openenv_session``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from opentinker.errors import InvalidArgumentError
from opentinker.game import AbstractGame, StepResult, Tool
from opentinker.services.envhub.adapters.openenv_actions import (
    ActionError,
    ActionFormat,
    observation_text,
    tools_of,
)
from opentinker.services.envhub.adapters.openenv_session import (
    OpenEnvSession,
    fetch_schema,
)
from opentinker.services.envhub.adapters.serve_args import ADAPTER_TIMEOUT_S


@dataclass(frozen=True)
class OpenEnvTarget:
    """The OpenEnv server one adapter serves, and how its episodes are presented.

    url: its base URL (``http://host:8000``). name: the environment name we register.
    action_format: built from its action schema. system_prompt: shown to the model.
    max_turns: the turn limit we declare (0 = none). timeout_s: per WebSocket reply.
    """

    url: str
    name: str
    action_format: ActionFormat
    system_prompt: str
    max_turns: int
    timeout_s: float


def discover(
    url: str,
    *,
    name: str,
    max_turns: int = 0,
    timeout_s: float = ADAPTER_TIMEOUT_S,
    system_prompt: str = "",
) -> OpenEnvTarget:
    """Read the server's action schema (and, for an MCP server, its tools) once."""
    action_format = ActionFormat.of(fetch_schema(url, timeout_s=timeout_s)["action"])
    if action_format.mcp:
        session = OpenEnvSession(url, timeout_s=timeout_s)
        try:
            session.reset({})
            listed = session.step({"type": "list_tools"})
        finally:
            session.close()
        action_format = action_format.with_tools(tools_of(listed.observation))
    prompt = system_prompt or f"You act in the environment '{name}'."
    return OpenEnvTarget(
        url=url,
        name=name,
        action_format=action_format,
        system_prompt=f"{prompt}\n{action_format.instructions()}",
        max_turns=max_turns,
        timeout_s=timeout_s,
    )


class OpenEnvGame(AbstractGame):
    """One episode on the OpenEnv server ``target`` names."""

    description = "an OpenEnv server, through the OpenEnv adapter"

    def __init__(self, target: OpenEnvTarget) -> None:
        self._target = target
        self._session = OpenEnvSession(target.url, timeout_s=target.timeout_s)

    # AbstractGame declares these as ClassVars; here they are per server, from the instance.
    @property
    def name(self) -> str:  # type: ignore[override]
        return self._target.name

    @property
    def max_turns(self) -> int:  # type: ignore[override]
        return self._target.max_turns

    @property
    def tools(self) -> tuple[Tool, ...]:  # type: ignore[override]
        return self._target.action_format.tools

    def get_system_prompt(self) -> str:
        return self._target.system_prompt

    def reset(self, *, seed: int = 0, **options: str) -> str:
        reply = self._session.reset({"seed": seed, **{k: _option(v) for k, v in options.items()}})
        return observation_text(reply.observation)

    def step(self, action: str) -> StepResult:
        try:
            actions = self._target.action_format.actions_of(action)
        except ActionError as err:
            return _told(str(err))
        if not actions:  # an MCP turn without a tool call: the model's final answer
            return StepResult(observation="", reward=0.0, done=True, info={"stop": "no_tool_call"})
        texts, reward, done = [], 0.0, False
        for one in actions:
            try:
                reply = self._session.step(one)
            except InvalidArgumentError as err:  # the server's schema refused the action
                return _told(err.message)
            texts.append(observation_text(reply.observation))
            reward += reply.reward or 0.0
            if reply.done:
                done = True
                break
        return StepResult(observation="\n".join(texts), reward=reward, done=done)

    def close(self) -> None:
        self._session.close()


def _told(problem: str) -> StepResult:
    """The model's invalid action: say what was wrong, no reward, the episode goes on."""
    return StepResult(
        observation=f"Invalid action: {problem}",
        reward=0.0,
        done=False,
        info={"action_error": problem[:500]},
    )


def _option(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value
