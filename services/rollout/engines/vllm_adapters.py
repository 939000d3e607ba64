"""What the vLLM engine keeps beside vLLM: the names and shapes a weight update may carry, and
the LoRA adapter of each policy version written as a PEFT folder vLLM loads (no vLLM import).

vLLM takes a LoRA adapter as a folder (``adapter_config.json`` + ``adapter_model.safetensors``,
PEFT's format) named by a ``LoRARequest``; a new policy version is a new folder and a new
request id, so it is hot-loaded without a restart. The trainer sends tensors under the names
of its PeftModel's parameters (``...q_proj.lora_A.default.weight``); PEFT's files drop the
adapter name (``...q_proj.lora_A.weight``), which ``peft_key`` does.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from peft.utils import load_peft_weights
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from opentinker.services.modeling.adapters import peft_lora_config
from opentinker.services.rollout.engines.engine import WeightUpdateError
from opentinker.spec import ModelSpec

ADAPTER_WEIGHTS = "adapter_model.safetensors"
_ADAPTER_NAME = re.compile(r"\.(lora_[A-Za-z_]+)\.default(?=\.|$)")  # embeddings: no .weight

# vLLM allocates LoRA slots for these ranks only (``max_lora_rank``'s choices).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank_for(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for slot in VLLM_LORA_RANKS:
        if rank <= slot:
            return slot
    raise WeightUpdateError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")


def peft_key(name: str) -> str:
    """A PeftModel parameter name -> its key in a saved adapter (the adapter name dropped)."""
    return _ADAPTER_NAME.sub(r".\1", name)


@dataclass(frozen=True)
class WeightShapes:
    """Name -> shape of every tensor a weight update may carry (the trainer's names)."""

    shapes: dict[str, tuple[int, ...]]
    what: str  # "adapter" or "model", for messages

    @classmethod
    def of(cls, spec: ModelSpec) -> WeightShapes:
        """The trainer's trainable tensors for ``spec``, from a model on the meta device
        (no memory, nothing loaded but the config)."""
        config = AutoConfig.from_pretrained(spec.base_model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        if spec.finetune == "lora":
            model = peft.get_peft_model(model, peft_lora_config(spec.lora, spec.base_model))
            named = {n: p for n, p in model.named_parameters() if p.requires_grad}
            return cls({n: tuple(p.shape) for n, p in named.items()}, "adapter")
        return cls({n: tuple(p.shape) for n, p in model.named_parameters()}, "model")

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """WeightUpdateError naming the first tensor the model does not have or whose shape
        differs; checked before anything is applied, so a bad update changes nothing."""
        for name, tensor in tensors.items():
            if name not in self.shapes:
                raise WeightUpdateError(
                    f"weight update names tensor {name!r}, which this {self.what} does not have "
                    f"(is the LoRA config the same as the trainer's?)"
                )
            if tuple(tensor.shape) != self.shapes[name]:
                raise WeightUpdateError(
                    f"weight update tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the {self.what}'s has {self.shapes[name]}"
                )


class AdapterVersions:
    """The served LoRA adapter as CPU tensors, and one PEFT folder per version under ``root``.

    Starts from ``spec.init_adapter`` when there is one, else from zeros (what a fresh
    adapter computes: its B is zero, so the base model's outputs). An update may come in
    parts (``update``); ``write(version)`` saves what is held as a folder of that version.
    """

    def __init__(self, spec: ModelSpec, shapes: WeightShapes, root: Path) -> None:
        self.spec = spec
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = peft_lora_config(spec.lora, spec.base_model)
        self.state: dict[str, torch.Tensor] = {
            peft_key(n): torch.zeros(shape, dtype=torch.float32)
            for n, shape in shapes.shapes.items()
        }
        self.changed = False
        if spec.init_adapter is not None:
            saved = load_peft_weights(spec.init_adapter, device="cpu")
            unknown = sorted(set(saved) - set(self.state))
            if unknown:
                raise WeightUpdateError(
                    f"init_adapter {spec.init_adapter} has tensors this LoRA config does not: "
                    f"{unknown[:3]}"
                )
            self.state.update({k: v.float() for k, v in saved.items()})
            self.changed = True

    def update(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take part or all of an update (trainer names; checked by ``WeightShapes`` first)."""
        for name, tensor in tensors.items():
            self.state[peft_key(name)] = tensor.detach().to("cpu", torch.float32, copy=True)
        self.changed = self.changed or bool(tensors)

    def folder(self, version: int, suffix: str = "") -> Path:
        return self.root / f"v{version}{suffix}"

    def write(self, version: int, *, suffix: str = "") -> Path:
        """Save the adapter as ``version``'s PEFT folder (config + safetensors); its path.
        suffix: tells apart a second folder of the same version (a re-sent update)."""
        out = self.folder(version, suffix)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        self.config.save_pretrained(str(out))
        save_file({k: v.contiguous() for k, v in self.state.items()}, str(out / ADAPTER_WEIGHTS))
        self.changed = False
        return out

    def drop(self, version: int, suffix: str = "") -> None:
        """Delete a version's folder (vLLM has its own copy once loaded)."""
        shutil.rmtree(self.folder(version, suffix), ignore_errors=True)
