"""The ``EnvironmentService`` servicer of the SDK's env server: protobuf <-> ``EpisodeTable``,
typed errors -> gRPC status codes, nothing else."""

from __future__ import annotations

import json
from typing import NoReturn

import grpc
import structlog

from opentinker.envhub.v1 import environment_pb2, environment_pb2_grpc
from opentinker.episode_table import EpisodeTable
from opentinker.errors import (
    REASON_METADATA_KEY,
    EnvironmentError_,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
    ResourceExhaustedError,
    UnavailableError,
)
from opentinker.game import AbstractGame, Image, Tool

SERVICE_NAME = environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name

log = structlog.get_logger("opentinker.env_server")

_STATUS_OF: dict[type[OpenTinkerError], grpc.StatusCode] = {
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    EnvironmentError_: grpc.StatusCode.INTERNAL,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,  # a backend the game wraps is unreachable
}


def _abort(context: grpc.ServicerContext, err: OpenTinkerError) -> NoReturn:
    if err.reason:
        context.set_trailing_metadata(((REASON_METADATA_KEY, err.reason),))
    context.abort(_STATUS_OF.get(type(err), grpc.StatusCode.INTERNAL), err.message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    """Protobuf <-> EpisodeTable; typed errors -> status codes."""

    def __init__(self, table: EpisodeTable, spec: environment_pb2.EnvironmentSpec) -> None:
        self._table = table
        self._spec = spec

    def GetEnvironmentSpec(self, request, context):  # noqa: N802
        return environment_pb2.GetEnvironmentSpecResponse(spec=self._spec)

    def Reset(self, request, context):  # noqa: N802
        try:
            system_prompt, observation = self._table.reset(
                request.episode_id, request.seed, dict(request.options)
            )
            images = self._table.initial_images(request.episode_id)
            first_role = self._table.first_role(request.episode_id)
        except OpenTinkerError as err:
            log.warning("reset_failed", env=self._table.env_name, error=err.message)
            _abort(context, err)
        return environment_pb2.ResetResponse(
            system_prompt=system_prompt,
            observation=observation,
            observation_images=image_parts_of(images),
            next_role=first_role,
        )

    def Step(self, request, context):  # noqa: N802
        try:
            result = self._table.step(request.episode_id, request.action)
        except OpenTinkerError as err:
            log.warning("step_failed", env=self._table.env_name, error=err.message)
            _abort(context, err)
        return environment_pb2.StepResponse(
            observation=result.observation,
            reward=float(result.reward),
            done=result.done,
            info=result.info,
            observation_images=image_parts_of(result.images),
            next_role=result.next_role,
            role_rewards={role: float(r) for role, r in result.role_rewards.items()},
        )

    def CloseEpisode(self, request, context):  # noqa: N802
        self._table.close(request.episode_id)
        return environment_pb2.CloseEpisodeResponse()


def spec_of(game: AbstractGame, env_name: str) -> environment_pb2.EnvironmentSpec:
    """The ``EnvironmentSpec`` a game's class attributes (and its system prompt) describe."""
    try:
        system_prompt = game.get_system_prompt()
    except Exception:  # a prompt that depends on reset() state; each ResetResponse carries it
        system_prompt = ""
    return environment_pb2.EnvironmentSpec(
        name=env_name,
        description=game.description,
        system_prompt=system_prompt if isinstance(system_prompt, str) else "",
        max_turns=game.max_turns,
        tools=[tool_spec_of(tool) for tool in game.tools],
        uses_images=game.uses_images,
        roles=[
            environment_pb2.RoleSpec(name=role.name, system_prompt=role.system_prompt)
            for role in game.roles
        ],
    )


def image_parts_of(images: tuple[Image, ...]) -> list[environment_pb2.ImagePart]:
    """A game's images as the protocol's ImageParts (the limits are checked by EnvHub)."""
    return [environment_pb2.ImagePart(data=i.data, mime_type=i.mime_type) for i in images]


def tool_spec_of(tool: Tool) -> environment_pb2.ToolSpec:
    """A game's ``Tool`` as the protocol's ``ToolSpec`` (its schema as JSON text)."""
    return environment_pb2.ToolSpec(
        name=tool.name,
        description=tool.description,
        parameters_json_schema=json.dumps(tool.parameters, sort_keys=True),
    )
