"""A base model read from disk before the job that will use it is known (warm spares).

A spare trainer or rollout process (``services/modeling/spare.py``) loads the tokenizer and the
model of one base model while it waits; the job it is handed then builds its policy (LoRA
wrapper or all parameters) on that object instead of reading the files again. The object is
handed out at most once: it belongs to exactly one job, in a process that serves only that job
(or, in a spare reused for its tenant's jobs, one job at a time: ``take_back``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import structlog
import torch
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from opentinker.services.modeling.model_key import model_key
from opentinker.services.modeling.vision_inputs import load_language_model

log = structlog.get_logger(__name__)


@dataclass
class PreloadedModel:
    """``base_model``'s tokenizer and model: float32, on CPU, in eval mode, never trained."""

    key: str  # model_key(base_model)
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel
    # Set by a LoRA job that wrapped ``model`` (peft changes it in place): the wrapped model,
    # which a reused spare keeps for the next job asking for the same wrap (kept_wrap.py).
    kept: KeptWrap | None = None


@dataclass(frozen=True)
class KeptWrap:
    """``PreloadedModel.model`` wrapped by a job: the wrapper (a peft model) and what it was
    wrapped for (kept_wrap.WrapKey); the model then no longer serves as a plain base."""

    model: torch.nn.Module
    wrapped_for: Hashable


def load_base(base_model: str) -> PreloadedModel:
    """Read ``base_model`` through ``from_pretrained`` onto the CPU (CUDA is not touched, so
    the process can still be given its devices at hand-over)."""
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = load_language_model(base_model, dtype=torch.float32)
    model.eval()
    return PreloadedModel(model_key(base_model), tokenizer, model)


class Preload:
    """At most one preloaded model, given away once, to a job asking for that same base."""

    def __init__(self, preloaded: PreloadedModel | None = None) -> None:
        self._preloaded = preloaded
        self._lent: PreloadedModel | None = None  # given to the job running now

    @classmethod
    def of(cls, base_model: str | None) -> Preload:
        """Load ``base_model`` now; a model that cannot be loaded leaves the preload empty (the
        job then loads it itself, and fails with the usual message)."""
        if not base_model:
            return cls()
        try:
            return cls(load_base(base_model))
        except (OSError, ValueError) as err:
            log.warning("preload_failed", model=base_model, error=f"{type(err).__name__}: {err}")
            return cls()

    def take(self, base_model: str) -> PreloadedModel | None:
        """The preloaded model when it is ``base_model``'s and not given away yet; else None."""
        preloaded = self._preloaded
        if preloaded is None or preloaded.key != model_key(base_model):
            return None
        self._preloaded = None
        self._lent = preloaded
        return preloaded

    def take_back(self) -> bool:
        """After a job that ended well (a spare reused for its tenant's next job): keep the
        model that job took if it left it wrapped (``kept``) for a job asking the same wrap;
        True when kept. False: nothing worth keeping (not taken, or trained in full), and the
        caller loads the base model afresh."""
        lent, self._lent = self._lent, None
        if lent is None or lent.kept is None:
            return False
        self._preloaded = lent
        return True
