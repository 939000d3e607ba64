"""Which generation engine a rollout runs: vLLM on CUDA devices, transformers elsewhere.

``OPENTINKER_ROLLOUT_ENGINE`` (``RolloutSettings.engine``): ``auto`` picks vLLM when the
rollout's device is CUDA and the ``vllm`` package is installed, else transformers, and logs
why; ``vllm`` asked for where it cannot run is a ConfigError naming the reason;
``transformers`` is always possible. Nothing here imports vLLM. A node's shared multi-LoRA
rollout chooses by the same rule (``shared_engine_loader``): vLLM's multi-LoRA on CUDA, peft's
mixed-adapter batches elsewhere.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Literal

import structlog
import torch

from opentinker.errors import ConfigError
from opentinker.services.rollout.engines.engine import GenerationEngine, TransformersEngine
from opentinker.services.rollout.engines.multi_lora import MixedLoraEngine, SharedLoraEngine
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.spec import ModelSpec

log = structlog.get_logger("opentinker.rollout.engine_choice")

EngineName = Literal["transformers", "vllm"]


def vllm_installed() -> bool:
    """Whether ``import vllm`` would find the package (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def choose_engine(
    setting: str, *, device: str, cuda_available: bool, vllm_importable: bool
) -> tuple[EngineName, str]:
    """The engine for ``setting`` ("auto" | "transformers" | "vllm") on ``device`` (the
    rollout's placement; "" = CUDA when there is one), and the reason, for the log."""
    on_cuda = device.startswith("cuda") or (device == "" and cuda_available)
    if setting == "transformers":
        return "transformers", "asked for"
    if setting == "vllm":
        if not on_cuda:
            raise ConfigError(
                f"OPENTINKER_ROLLOUT_ENGINE=vllm needs CUDA devices, but the rollout runs on "
                f"{device or 'cpu'!r} (a CPU lease, or no GPU visible); use 'auto' or "
                f"'transformers' here",
                reason="VLLM_NEEDS_CUDA",
            )
        if not vllm_importable:
            raise ConfigError(
                "OPENTINKER_ROLLOUT_ENGINE=vllm but the vllm package is not installed; "
                "install the extra (pip install 'opentinker[vllm]') or use 'auto'",
                reason="VLLM_NOT_INSTALLED",
            )
        return "vllm", "asked for"
    if setting != "auto":
        raise ConfigError(
            f"OPENTINKER_ROLLOUT_ENGINE={setting!r}: expected auto, transformers or vllm"
        )
    if not on_cuda:
        return "transformers", "auto: no CUDA device"
    if not vllm_importable:
        return "transformers", "auto: CUDA, but vllm is not installed"
    return "vllm", "auto: CUDA and vllm installed"


def engine_factory(
    settings: RolloutSettings,
    *,
    cuda_available: bool,
    vllm_importable: bool,
) -> tuple[EngineName, Callable[[ModelSpec], GenerationEngine]]:
    """The chosen engine's name and a factory loading it for a job's model."""
    name, why = choose_engine(
        settings.engine,
        device=settings.device,
        cuda_available=cuda_available,
        vllm_importable=vllm_importable,
    )
    log.info("engine_chosen", engine=name, reason=why, device=settings.device or "default")
    if name == "vllm":
        from opentinker.services.rollout.engines.vllm_engine import (
            VllmEngine,  # needs vllm; imported only when chosen
        )

        device = settings.device or "cuda:0"
        return name, lambda spec: VllmEngine.load(spec, settings, device=device)
    return name, lambda spec: TransformersEngine.load(
        spec, max_batch_size=settings.max_batch_size, device=settings.device or None
    )


def shared_engine_loader(
    settings: RolloutSettings,
    *,
    base_model: str,
    capacity: int,
    max_lora_rank: int,
    cuda_available: bool,
    vllm_importable: bool,
) -> tuple[EngineName, Callable[[], MixedLoraEngine]]:
    """A shared rollout's engine for ``capacity`` LoRA jobs of ``base_model`` (ranks up to
    ``max_lora_rank``): its name and a loader. The choice is ``choose_engine``'s."""
    name, why = choose_engine(
        settings.engine,
        device=settings.device,
        cuda_available=cuda_available,
        vllm_importable=vllm_importable,
    )
    log.info("shared_engine_chosen", engine=name, reason=why, device=settings.device or "default")
    if name == "vllm":
        from opentinker.services.rollout.engines.vllm_multi_lora import (
            VllmMixedLoraEngine,  # needs vllm; imported only when chosen
        )

        device = settings.device or "cuda:0"
        return name, lambda: VllmMixedLoraEngine.load(
            base_model, settings, capacity=capacity, max_lora_rank=max_lora_rank, device=device
        )
    device = settings.device or ("cuda" if cuda_available else "cpu")
    return name, lambda: SharedLoraEngine.load(
        base_model, device=device, max_batch_size=settings.max_batch_size
    )


def default_engine_factory(settings: RolloutSettings) -> Callable[[ModelSpec], GenerationEngine]:
    """The engine ``settings.engine`` picks for the rollout's device: vLLM on CUDA when
    installed, transformers otherwise."""
    return engine_factory(
        settings, cuda_available=torch.cuda.is_available(), vllm_importable=vllm_installed()
    )[1]
