"""ModelService over gRPC: protobuf <-> ModelCatalog, errors -> codes."""

from __future__ import annotations

import grpc
import structlog

from opentinker.errors import ConfigError, OpenTinkerError
from opentinker.scheduler.v1 import models_pb2 as pb
from opentinker.scheduler.v1 import models_pb2_grpc
from opentinker.services.common.auth import ADMINS, USERS, current_principal, rules_for
from opentinker.services.common.grpc_server import abort_with
from opentinker.services.scheduler.model_catalog import ModelCatalog

log = structlog.get_logger(__name__)

ACCESS_RULES = rules_for(
    pb.DESCRIPTOR.services_by_name["ModelService"],
    {"ListModels": USERS, "RegisterModel": ADMINS, "RemoveModel": ADMINS},
)


class ModelServicer(models_pb2_grpc.ModelServiceServicer):
    def __init__(self, catalog: ModelCatalog) -> None:
        self._catalog = catalog

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            start, size = _page_bounds(request.page_size, request.page_token)
            models = await self._catalog.list_models()
        except OpenTinkerError as err:
            await abort_with(context, err)
        end = len(models) if size == 0 else start + size
        more = str(end) if end < len(models) else ""
        return pb.ListModelsResponse(models=models[start:end], next_page_token=more)

    async def RegisterModel(
        self, request: pb.RegisterModelRequest, context: grpc.aio.ServicerContext
    ):  # noqa: N802
        try:
            model = await self._catalog.put(request.model)
        except OpenTinkerError as err:
            await abort_with(context, err)
        _audit("model_registered", name=model.name, location=model.location)
        return pb.RegisterModelResponse(model=model)

    async def RemoveModel(self, request: pb.RemoveModelRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            await self._catalog.remove(request.name)
        except OpenTinkerError as err:
            await abort_with(context, err)
        _audit("model_removed", name=request.name)
        return pb.RemoveModelResponse()


def _page_bounds(page_size: int, page_token: str) -> tuple[int, int]:
    """(first index, size; 0 = all the rest)."""
    if page_size < 0 or (page_token and not page_token.isdigit()):
        raise ConfigError(
            "page_size must be >= 0 and page_token one this server issued", reason="INVALID_PAGE"
        )
    return int(page_token or 0), page_size


def _audit(event: str, **fields: str) -> None:
    log.info(event, by=current_principal().describe(), **fields)
