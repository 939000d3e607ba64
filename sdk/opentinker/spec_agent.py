"""An agent program in a job spec (``RlConfig.agent`` / ``InferenceConfig.agent``): code of its
own that plays each episode through the rollout's per-episode OpenAI-compatible endpoint.

agent = AgentProgram(callable="my_agents.calculator:play")   # a Python function, or
agent = AgentProgram(command=["python", "agent.py"])          # a command line
"""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from opentinker.common.v1 import common_pb2
from opentinker.spec_parts import StrictModel

DEFAULT_AGENT_TIMEOUT_S = 300.0
_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class AgentProgram(StrictModel):
    """Exactly one of ``callable`` ("package.module:function", called with base_url, api_key,
    task and seed; returns the reward or None) and ``command`` (argv; OPENAI_BASE_URL and
    OPENAI_API_KEY in its environment, the reward as JSON on stdout's last line)."""

    callable: str = Field(
        "", description='"package.module:function", importable by the rollout process.'
    )
    command: tuple[str, ...] = Field((), description="A command line started per episode.")
    timeout_s: float = Field(
        DEFAULT_AGENT_TIMEOUT_S, gt=0, le=86_400, description="Seconds one episode may run."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> AgentProgram:
        if bool(self.callable) == bool(self.command):
            raise ValueError(
                "set exactly one of callable ('package.module:function') and command (argv)"
            )
        if self.callable and not _CALLABLE.match(self.callable):
            raise ValueError(
                f"callable {self.callable!r} is not 'package.module:function' "
                "(e.g. 'my_agents.calculator:play')"
            )
        if self.command and not self.command[0]:
            raise ValueError("command[0] (the program) is empty")
        return self


def agent_to_proto(a: AgentProgram) -> common_pb2.AgentProgram:
    return common_pb2.AgentProgram(
        callable=a.callable, command=list(a.command), timeout_s=a.timeout_s
    )


def agent_fields(pb: common_pb2.AgentProgram) -> dict:
    """The set fields of a wire AgentProgram, as spec input (unset = the default)."""
    data: dict = {"callable": pb.callable, "command": tuple(pb.command)}
    if pb.timeout_s:
        data["timeout_s"] = pb.timeout_s
    return data
