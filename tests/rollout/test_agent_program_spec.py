"""The agent program of a job spec: validated naming the field, and it round-trips the wire
(JobSpec -> proto -> JobSpec, and into the rollout's OpenRollout)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from opentinker.services.rollout.config import config_from_proto
from opentinker.services.trainer.rollout_link.rollout_wire import open_request
from opentinker.spec import InferenceConfig, JobSpec, ModelSpec, RlConfig, from_proto, to_proto
from opentinker.spec_agent import AgentProgram


def test_an_agent_program_round_trips_and_reaches_the_rollout() -> None:
    agent = AgentProgram(callable="my_agents.calc:play", timeout_s=30)
    spec = JobSpec(
        name="a", model=ModelSpec(base_model="m"), rl=RlConfig(env_name="e", agent=agent)
    )
    assert from_proto(to_proto(spec)).rl.agent == agent
    rollout = config_from_proto(open_request("job-1", spec))
    assert rollout.agent == agent
    plain = JobSpec(name="b", model=ModelSpec(base_model="m"), rl=RlConfig(env_name="e"))
    assert config_from_proto(open_request("job-2", plain)).agent is None


def test_an_inference_job_takes_a_command() -> None:
    agent = AgentProgram(command=("python", "agent.py"))
    spec = JobSpec(
        name="i",
        kind="inference",
        model=ModelSpec(base_model="m"),
        inference=InferenceConfig(env_name="e", agent=agent),
    )
    assert from_proto(to_proto(spec)).inference.agent == agent
    assert config_from_proto(open_request("job-3", spec)).agent == agent


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({}, "exactly one of callable"),
        ({"callable": "m:f", "command": ["x"]}, "exactly one of callable"),
        ({"callable": "no_colon"}, "not 'package.module:function'"),
        ({"command": [""]}, "command[0]"),
        ({"command": ["x"], "timeout_s": 0}, "timeout_s"),
    ],
)
def test_a_bad_agent_program_is_refused_naming_the_field(fields: dict, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        RlConfig(env_name="e", agent=fields)
    assert "agent" in str(err.value) and words in str(err.value)


def test_a_rollout_refuses_agent_programs_unless_its_operator_enables_them() -> None:
    """An agent program is the tenant's code run by the rollout on the worker (a command, or a
    module it imports): refused by name unless the pool's operator turned them on."""
    import asyncio

    from opentinker.errors import FailedPreconditionError
    from opentinker.services.rollout.session import RolloutSession
    from opentinker.services.rollout.settings import RolloutSettings

    spec = JobSpec(
        name="a",
        model=ModelSpec(base_model="m"),
        rl=RlConfig(env_name="e", agent=AgentProgram(command=("cat", "/etc/passwd"))),
    )
    config = config_from_proto(open_request("job-9", spec))

    def no_engine(_spec):
        raise AssertionError("a refused job loads no model")

    session = RolloutSession(RolloutSettings(envhub_address="127.0.0.1:1"), no_engine)
    with pytest.raises(FailedPreconditionError, match="OPENTINKER_ROLLOUT_AGENT_PROGRAMS"):
        asyncio.run(session.open(config))
    assert session.config is None
