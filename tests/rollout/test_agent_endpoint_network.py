"""The agent endpoint off loopback: bound to every interface (OPENTINKER_AGENT_ENDPOINT_HOST)
and advertised as one of this machine's non-loopback addresses (…_ADVERTISE_HOST), an agent
program gets that address in its base_url and plays through it; the per-episode key still
holds (401); a wildcard bind without an advertised host is refused naming the variable."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlparse

import openai
import pytest
from agent_loop_helpers import Countdown, GameSession, RecordingEngine

from opentinker.errors import ConfigError
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.agent_endpoint.settings import EndpointSettings
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import FinishReason
from opentinker.spec import SamplingParams
from opentinker.spec_agent import AgentProgram

pytestmark = pytest.mark.integration


def _outward_address() -> str | None:
    """An address of this machine's interface toward the default route (a UDP "connect"
    sends nothing), or None where there is only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


SEEN: list[dict] = []


def remote_agent(*, base_url: str, api_key: str, task: str, seed: int) -> float:
    """Plays one call through the base_url it was given; a wrong key must get 401."""
    seen: dict = {"base_url": base_url}
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=base_url, api_key="not-this-one", max_retries=0).models.list()
    seen["wrong_key_status"] = refused.value.status_code
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task}]
    )
    seen["content"] = reply.choices[0].message.content
    SEEN.append(seen)
    return 1.0


def test_an_agent_reaches_the_endpoint_on_a_non_loopback_address(
    base_engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = _outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to reach the endpoint on")
    monkeypatch.setenv("OPENTINKER_AGENT_ENDPOINT_HOST", "0.0.0.0")
    monkeypatch.setenv("OPENTINKER_AGENT_ENDPOINT_ADVERTISE_HOST", address)
    engine = RecordingEngine(base_engine)
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
        max_turns=2,
        max_episode_tokens=256,
        agent=AgentProgram(callable="test_agent_endpoint_network:remote_agent"),
    )
    session = GameSession(Countdown(turns=1))

    async def run() -> list:
        loop = AgentLoop(engine, config)  # type: ignore[arg-type]
        assert loop.agent_programs is not None
        assert loop.agent_programs.server.host == "0.0.0.0"
        try:
            trajectories, _ = await loop.run([EpisodeRequest("ep-0", 0, 0, session)], seed=3)
        finally:
            await loop.agent_programs.close()
        return trajectories

    [t] = asyncio.run(run())
    assert t.finish_reason is FinishReason.ENV_DONE and t.reward == 1.0, t.finish_detail
    [seen] = SEEN
    assert urlparse(seen["base_url"]).hostname == address
    assert seen["wrong_key_status"] == 401
    assert sum(t.loss_mask) == len(engine.completions[0].token_ids) > 0


def test_settings_default_to_loopback_and_refuse_an_unadvertised_wildcard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HOST", "ADVERTISE_HOST"):
        monkeypatch.delenv(f"OPENTINKER_AGENT_ENDPOINT_{name}", raising=False)
    assert EndpointSettings.load().url_host == "127.0.0.1"
    assert EndpointSettings.load(host="::", advertise_host="node-7").url_host == "node-7"
    monkeypatch.setenv("OPENTINKER_AGENT_ENDPOINT_HOST", "0.0.0.0")
    with pytest.raises(ConfigError, match="OPENTINKER_AGENT_ENDPOINT_ADVERTISE_HOST"):
        EndpointSettings.load()
