"""What the rollout accepts from an environment, and which env failures it restarts.

EnvHub and the Python SDK check replies too, but an env written in another language (or a
different hub) may not; the rollout checks again so a bad reply ends one episode with a
recorded reason instead of poisoning a batch with NaN rewards or a megabyte prompt.
"""

from __future__ import annotations

import json
import math
import re
from typing import Protocol

from opentinker.envhub.v1 import environment_pb2
from opentinker.errors import InvalidArgumentError, OpenTinkerError, UnavailableError
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.types import EnvSpec, ResetResult, RoleSpec, StepOutcome, ToolSpec

_ROLE_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")

# Status codes that mean the episode's env instance died or stopped answering: the episode is
# restarted from Reset (EnvHub routes the new Reset to a live instance). A Step answered
# NOT_FOUND means the same: the env lost the episode (a server restarted at the same address,
# an episode reaped as idle). Any other failure is the env's own doing (it raised, replied
# badly, or is not registered) and is final.
RESTARTABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
LOST_EPISODE_CODE = "NOT_FOUND"  # of a Step


class EnvLinkLostError(UnavailableError):
    """The rollout's own link to the environments (its EnvHub stream) broke, not the env.

    Every episode on that link is lost with it (EnvHub keeps no episode across a restart);
    the agent loop starts each over from Reset, on a session that waits for the link to be
    back, without using the episode's ``max_episode_retries`` (those are for env failures).
    """


def is_restartable(err: OpenTinkerError | TimeoutError, *, stepping: bool = False) -> bool:
    """True when ``err`` says the env instance died or timed out (a bare TimeoutError too),
    or (``stepping``: the error of a Step) that it lost the episode."""
    if isinstance(err, TimeoutError) or err.code in RESTARTABLE_CODES:
        return True
    return stepping and err.code == LOST_EPISODE_CODE


class Restartable(Protocol):
    """An episode of the agent loop or a game of the self-play coordinator: its request (which
    can ``reopen`` a session, or not), its restarts so far and how many used its env retries."""

    request: EpisodeRequest
    retries: int
    restarts: int


def restart_after(
    err: OpenTinkerError | TimeoutError,
    item: Restartable,
    config: LoopConfig,
    *,
    stepping: bool = False,
) -> tuple[str, str]:
    """How an episode (or game) goes on after ``err`` (``stepping``: of a Step): ("link", "")
    = start over without using its retries (the link to the envs broke), ("env", "") = start
    over using one (its env instance died or lost it), ("", why) = end it with ENV_ERROR,
    ``why`` added to the reason."""
    can_reopen, retries = item.request.reopen is not None, item.retries
    link_restarts = item.restarts - retries
    max_retries, max_link_restarts = config.max_episode_retries, config.max_link_restarts
    why = ""
    if isinstance(err, EnvLinkLostError) and can_reopen:
        if link_restarts < max_link_restarts:
            return "link", ""
        why = f" (the link to the envs was lost {link_restarts + 1} times)"
        can_reopen = False
    if not is_restartable(err, stepping=stepping) or not can_reopen:
        return "", why + (f" (on restart {retries})" if retries else "")
    if retries >= max_retries:
        return "", f" (gave up after {retries} restarts; max_episode_retries={max_retries})"
    return "env", ""


def reset_problem(reset: ResetResult, max_observation_chars: int) -> str:
    """Why a Reset reply cannot start an episode ('' when it can)."""
    if not reset.system_prompt and not reset.observation:
        return "the reset reply has neither system_prompt nor observation (missing fields)"
    return _size_problem("reset observation", reset.observation, max_observation_chars)


MAX_REWARD = 1e30  # under float32's 3.4e38: turn rewards reach the trainer as float32, and a
# larger one arrived as inf, its advantages NaN


def step_problem(outcome: StepOutcome, max_observation_chars: int) -> str:
    """Why a Step reply cannot be used ('' when it can): a non-finite reward, a huge observation."""
    if not math.isfinite(outcome.reward):
        return f"the step reply has a non-finite reward ({outcome.reward})"
    if abs(outcome.reward) > MAX_REWARD:  # the trainer gets turn rewards as float32
        return f"the step reply's reward {outcome.reward:g} is beyond ±{MAX_REWARD:g}"
    return _size_problem("step observation", outcome.observation, max_observation_chars)


def _size_problem(what: str, text: str, limit: int) -> str:
    if len(text) > limit:
        return (
            f"the {what} has {len(text)} characters, more than max_observation_chars={limit}; "
            "make the env send less (or raise the limit)"
        )
    return ""


def env_spec_from_proto(pb: environment_pb2.EnvironmentSpec) -> EnvSpec:
    """The domain view of an env's spec; raises InvalidArgumentError for a tool whose
    ``parameters_json_schema`` is not a JSON object (naming the env and the tool)."""
    tools = []
    for tool in pb.tools:
        try:
            parameters = json.loads(tool.parameters_json_schema or "{}")
        except json.JSONDecodeError as err:
            parameters = err
        if not isinstance(parameters, dict):
            raise InvalidArgumentError(
                f"environment '{pb.name}' declares tool {tool.name!r} whose "
                f"parameters_json_schema is not a JSON object: {tool.parameters_json_schema!r}",
                code="INVALID_ARGUMENT",
            )
        tools.append(ToolSpec(tool.name, tool.description, parameters))
    return EnvSpec(
        name=pb.name,
        system_prompt=pb.system_prompt,
        tools=tuple(tools),
        max_turns=max(pb.max_turns, 0),
        roles=_roles_of(pb),
    )


def _roles_of(pb: environment_pb2.EnvironmentSpec) -> tuple[RoleSpec, ...]:
    """The spec's roles; raises InvalidArgumentError for an empty, odd or repeated name."""
    names = [role.name for role in pb.roles]
    bad = [name for name in names if not _ROLE_NAME.match(name)]
    if bad or len(set(names)) != len(names):
        raise InvalidArgumentError(
            f"environment '{pb.name}' declares roles {names}: each must be unique, 1-64 "
            "characters of letters, digits, '_' or '-'",
            code="INVALID_ARGUMENT",
        )
    return tuple(RoleSpec(role.name, role.system_prompt) for role in pb.roles)


def role_problem(
    next_role: str, roles: tuple[str, ...], rewards: dict[str, float], *, next_role_due: bool
) -> str:
    """Why a multi-agent reply cannot be used ('' when it can): no next role or an unknown
    one (when one is due: the game goes on), a reward for an unknown role or a non-finite one."""
    if next_role_due and not next_role:
        return f"it names no next_role; an env with roles {list(roles)} must say who acts next"
    if next_role_due and next_role not in roles:
        return f"its next_role {next_role!r} is not one of the env's roles {list(roles)}"
    for role, reward in rewards.items():
        if role not in roles:
            return f"its role_rewards name {role!r}, not one of the env's roles {list(roles)}"
        if not math.isfinite(reward):
            return f"its role_rewards[{role!r}] is non-finite ({reward})"
    return ""
