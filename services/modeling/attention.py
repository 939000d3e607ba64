"""What a model's attention layers see, for the code that hands them a KV cache of its own."""

from __future__ import annotations

from torch import nn


def has_full_attention_only(model: nn.Module) -> bool:
    """Whether every attention layer of ``model`` sees the whole sequence (no sliding window,
    no linear attention): the only layers a cache of the whole prefix stands in for
    (trainer/model/shared_prompts.py, rollout/engines/prefix_cache.py)."""
    layer_types = getattr(getattr(model, "config", None), "layer_types", None) or ()
    return all(kind == "full_attention" for kind in layer_types)
