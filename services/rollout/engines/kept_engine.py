"""A reused rollout spare's engine: the last LoRA job's wrapped model, for the next job.

A rollout spare reused across one tenant's jobs (modeling/spare.py ``serve_jobs``) keeps the
wrapped model its last LoRA job left (modeling/kept_wrap.py) instead of reading the base from
its files and wrapping it again. The engine built on it is new (policy version 0, its own
generation config, no prefix cache); the adapter is made anew (``reset_adapter``, unseeded as
a fresh process's is), and the trainer's version-0 weights replace every adapter tensor before
the first episode, as they do in a fresh process (the probe then checks them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from opentinker.services.modeling.adapters import load_init_adapter
from opentinker.services.modeling.kept_wrap import (
    keep,
    kept_for,
    reset_adapter,
    usable_base,
    wrap_key,
)
from opentinker.services.modeling.placement import dtype_for_device
from opentinker.services.modeling.preload import Preload
from opentinker.services.modeling.template_choice import use_chat_template
from opentinker.services.modeling.vision_inputs import load_image_processor
from opentinker.services.rollout.engines.engine import GenerationEngine, TransformersEngine
from opentinker.spec import ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def kept_engine_factory(
    preload: Preload,
    fallback: Callable[[ModelSpec], GenerationEngine],
    *,
    max_batch_size: int,
    device: str | None,
) -> Callable[[ModelSpec], GenerationEngine]:
    """A transformers engine on a spare's preloaded base model, or on the model its last LoRA
    job wrapped for the same LoRA settings; otherwise whatever ``fallback`` makes."""

    def load(spec: ModelSpec) -> GenerationEngine:
        preloaded = preload.take(spec.base_model)
        if preloaded is None:
            return fallback(spec)
        target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        key = wrap_key(spec, dtype=dtype_for_device(str(target)), device=str(target))
        kept = kept_for(preloaded, key) if spec.finetune == "lora" else None
        if kept is None:
            base = usable_base(preloaded)
            if base is None:  # wrapped for another job: read the base as a cold process does
                return fallback(spec)
            engine = TransformersEngine.load(
                spec, max_batch_size=max_batch_size, device=device, preloaded=base
            )
            keep(preloaded, engine.model, key)  # the next job of a reused spare may take it
            return engine
        # As TransformersEngine.load finishes a fresh one.
        reset_adapter(kept, spec, seed=None)
        use_chat_template(preloaded.tokenizer, spec.chat_template)  # the job's choice, if any
        load_init_adapter(kept, spec, target)
        kept.eval()
        # PeftModel forwards every PreTrainedModel method (generate, named_parameters, ...)
        model = cast("PreTrainedModel", kept)
        engine = TransformersEngine(model, preloaded.tokenizer, max_batch_size=max_batch_size)
        engine.image_processor = load_image_processor(spec.base_model)
        return engine

    return load
