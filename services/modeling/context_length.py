"""How many tokens (prompt and completion together) a model takes: its context length."""

from __future__ import annotations

import structlog
from transformers import PreTrainedConfig

log = structlog.get_logger("opentinker.modeling.context_length")

# The config fields that bound a model's sequence length, as vLLM reads them
# (transformers_utils/model_arch_config_convertor.py): the smallest one set is the limit.
# vLLM then stretches it by a rope scaling factor; a transformers engine takes it as it is.
_LENGTH_FIELDS = (
    "max_position_embeddings",  # most models (GPT-2's n_positions maps to it too)
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
DEFAULT_CONTEXT_LENGTH = 2048  # vLLM's, for a config that sets none of them


def context_length(config: PreTrainedConfig) -> int:
    """The longest sequence (tokens) the model of ``config`` takes: of a vision-language model,
    its language model's. A config that names no length gets DEFAULT_CONTEXT_LENGTH (a bound
    all the same: a model without one still runs out of memory)."""
    text = config.get_text_config()
    # Model configs keep these as plain attributes, each model its own subset.
    lengths = [getattr(text, name, None) for name in _LENGTH_FIELDS]
    given = [n for n in lengths if isinstance(n, int) and n > 0]
    if given:
        return min(given)
    log.warning("context_length_unknown", model_type=text.model_type, used=DEFAULT_CONTEXT_LENGTH)
    return DEFAULT_CONTEXT_LENGTH
