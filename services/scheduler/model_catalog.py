"""The model catalog: the base models the pool has, by name, kept in Redis by the scheduler.

An entry says where the model lives on the workers (a folder, a .gguf the worker imports, or
a hub id), what it is (architecture, parameters, context length, whether its tokenizer has a
chat template) and which finetunes the pool runs on it. Admins register and remove entries
(``opentinker models register``); every user lists them (``opentinker models list``,
``Client.models()``, the gateway's capabilities, the dashboard). What a job may name is
decided from the catalog in ``model_admission.py``.

Redis layout (``prefix`` defaults to ``ot:models``)::

    <prefix>    HASH name -> a serialized opentinker.scheduler.v1.Model
"""

from __future__ import annotations

import re
import time
from typing import Protocol, cast

import redis.asyncio as aioredis

from opentinker.chat_templates import check_chat_template_choice
from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError, NotFoundError
from opentinker.scheduler.v1 import models_pb2

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
_FINETUNES = (common_pb2.FINETUNE_MODE_LORA, common_pb2.FINETUNE_MODE_FULL)


class ModelNotFoundError(NotFoundError):
    """No model of this name in the catalog (NOT_FOUND)."""


class ModelCatalog(Protocol):
    async def list_models(self) -> list[models_pb2.Model]:
        """Every entry, by name."""
        ...

    async def put(self, model: models_pb2.Model) -> models_pb2.Model:
        """Add ``model`` (checked: ConfigError naming the field), or replace the entry of its
        name; returns it as stored (with registered_unix_s)."""
        ...

    async def remove(self, name: str) -> None:
        """ModelNotFoundError when there is no entry of that name."""
        ...


def checked_entry(model: models_pb2.Model) -> models_pb2.Model:
    """A copy of ``model`` fit to store; ConfigError naming every field that is wrong."""
    problems = []
    if not NAME.fullmatch(model.name):
        problems.append(
            f"name {model.name!r}: letters, digits and ._-/ (starting with a letter or digit), "
            "at most 128 characters"
        )
    if model.parameters < 0:
        problems.append(f"parameters {model.parameters}: a count, >= 0")
    if model.context_length < 0:
        problems.append(f"context_length {model.context_length}: tokens, >= 0")
    if any(mode not in _FINETUNES for mode in model.finetunes):
        problems.append("finetunes: FINETUNE_MODE_LORA and/or FINETUNE_MODE_FULL")
    try:
        check_chat_template_choice(model.chat_template)
    except ValueError as err:
        problems.append(f"chat_template: {err}")
    if problems:
        raise ConfigError("model: " + "; ".join(problems), reason="INVALID_MODEL")
    entry = models_pb2.Model()
    entry.CopyFrom(model)
    del entry.finetunes[:]
    entry.finetunes.extend(sorted(set(model.finetunes)))
    return entry


class RedisModelCatalog:
    """The catalog as one Redis hash (module docstring)."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = "ot:models") -> None:
        self._r = client
        self.key = prefix

    async def list_models(self) -> list[models_pb2.Model]:
        raw = cast("dict[bytes, bytes]", await self._r.hgetall(self.key))
        entries = [models_pb2.Model.FromString(value) for value in raw.values()]
        return sorted(entries, key=lambda m: m.name)

    async def put(self, model: models_pb2.Model) -> models_pb2.Model:
        entry = checked_entry(model)
        entry.registered_unix_s = time.time()
        await self._r.hset(self.key, entry.name, entry.SerializeToString())
        return entry

    async def remove(self, name: str) -> None:
        if not await self._r.hdel(self.key, name):
            names = ", ".join(m.name for m in await self.list_models()) or "none"
            raise ModelNotFoundError(
                f"model {name!r} is not in the catalog (it has: {names})",
                reason="MODEL_NOT_FOUND",
            )


def model_names(models: list[models_pb2.Model]) -> str:
    """``a, b, c`` for messages."""
    return ", ".join(m.name for m in models)
