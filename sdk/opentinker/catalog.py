"""The pool's models as the SDK shows them (the scheduler's model catalog, models.proto).

for model in client.models():
    print(model.name, model.architecture, model.parameters, model.finetunes)
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.scheduler.v1 import models_pb2

_FINETUNES = {"lora": common_pb2.FINETUNE_MODE_LORA, "full": common_pb2.FINETUNE_MODE_FULL}


@dataclass(frozen=True)
class ModelInfo:
    """One base model of the pool.

    name: what a job names as ``model.base_model``. location: where it lives on the workers (a
    folder, a .gguf file, a hub id; "" = the name itself). parameters: number of weights (0 =
    not known). context_length: tokens (0 = not known). has_chat_template: its tokenizer has
    one. finetunes: "lora" and/or "full" ((): any). chat_template: what a job of it uses when
    its spec chooses none ("", "plain" or a Jinja template; ``opentinker.chat_templates``).
    registered_unix_s: set by the scheduler.
    """

    name: str
    location: str = ""
    architecture: str = ""
    parameters: int = 0
    context_length: int = 0
    has_chat_template: bool = False
    finetunes: tuple[str, ...] = field(default=())
    chat_template: str = ""
    description: str = ""
    registered_unix_s: float = 0.0

    def to_proto(self) -> models_pb2.Model:
        unknown = sorted(set(self.finetunes) - set(_FINETUNES))
        if unknown:
            raise ValueError(f"finetunes: {unknown} are not 'lora' or 'full'")
        return models_pb2.Model(
            name=self.name,
            location=self.location,
            architecture=self.architecture,
            parameters=self.parameters,
            context_length=self.context_length,
            has_chat_template=self.has_chat_template,
            finetunes=[_FINETUNES[f] for f in self.finetunes],
            chat_template=self.chat_template,
            description=self.description,
        )

    @classmethod
    def from_proto(cls, pb: models_pb2.Model) -> ModelInfo:
        names = {v: k for k, v in _FINETUNES.items()}
        return cls(
            name=pb.name,
            location=pb.location,
            architecture=pb.architecture,
            parameters=pb.parameters,
            context_length=pb.context_length,
            has_chat_template=pb.has_chat_template,
            finetunes=tuple(names[f] for f in pb.finetunes if f in names),
            chat_template=pb.chat_template,
            description=pb.description,
            registered_unix_s=pb.registered_unix_s,
        )


def describe_folder(path: Path) -> dict[str, Any]:
    """What a Hugging Face model folder says of itself, read from its files alone (no torch):
    architecture and context length from ``config.json``, parameters from the safetensors
    headers, whether a chat template ships (``chat_template.jinja`` or in
    ``tokenizer_config.json``). ConfigError naming the folder when it holds no config.json."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{path}: no readable config.json ({err}); a model folder is what save_pretrained "
            "writes (or `opentinker models import` makes from a GGUF)",
            reason="NOT_A_MODEL_FOLDER",
        ) from err
    text = config.get("text_config") or config  # multimodal configs nest the language model
    return {
        "architecture": str(config.get("model_type", "")),
        "context_length": int(text.get("max_position_embeddings") or 0),
        "parameters": sum(_safetensors_parameters(f) for f in sorted(path.glob("*.safetensors"))),
        "has_chat_template": _ships_chat_template(path),
    }


def _safetensors_parameters(file: Path) -> int:
    """Weights in one safetensors file, from its header (8-byte length, then JSON)."""
    with file.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(
        math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__"
    )


def _ships_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False
