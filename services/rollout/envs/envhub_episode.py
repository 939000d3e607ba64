"""One episode on an ``EnvHubClient`` stream: the agent loop's ``EnvSession`` over EnvHub."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Protocol

from opentinker.envhub.v1 import environment_pb2
from opentinker.services.common.tool_calls import ToolCalls
from opentinker.services.rollout.agent.multimodal import images_of
from opentinker.services.rollout.types import ResetResult, StepOutcome


class EpisodeStream(Protocol):
    """What an episode needs of its stream (``envhub_client.EnvHubClient``)."""

    async def request(
        self, episode_id: str, payload: environment_pb2.ResetRequest | environment_pb2.StepRequest
    ) -> environment_pb2.ResetResponse | environment_pb2.StepResponse: ...

    async def close_episode(self, episode_id: str) -> None: ...


class EnvHubEpisode:
    """One episode on an ``EnvHubClient`` stream; implements the agent loop's ``EnvSession``."""

    def __init__(self, client: EpisodeStream, episode_id: str) -> None:
        self.client = client
        self.episode_id = episode_id

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        reply = await self.client.request(
            self.episode_id,
            environment_pb2.ResetRequest(
                episode_id=self.episode_id, seed=seed, options=dict(options)
            ),
        )
        assert isinstance(reply, environment_pb2.ResetResponse)
        return ResetResult(
            system_prompt=reply.system_prompt,
            observation=reply.observation,
            images=images_of(reply.observation_images),
            next_role=reply.next_role,
        )

    async def step(self, action: str, tool_calls: ToolCalls | None = None) -> StepOutcome:
        request = environment_pb2.StepRequest(episode_id=self.episode_id, action=action)
        if tool_calls is not None:
            request.tool_calls.extend(
                environment_pb2.ToolCall(name=c.name, arguments_json=json.dumps(c.arguments))
                for c in tool_calls.calls
            )
            request.tool_call_errors.extend(tool_calls.errors)
        reply = await self.client.request(self.episode_id, request)
        assert isinstance(reply, environment_pb2.StepResponse)
        return StepOutcome(
            observation=reply.observation,
            reward=reply.reward,
            done=reply.done,
            info=dict(reply.info),
            images=images_of(reply.observation_images),
            next_role=reply.next_role,
            role_rewards=dict(reply.role_rewards),
        )

    async def close(self) -> None:
        await self.client.close_episode(self.episode_id)
