"""The trainer's forward over an episode with images: the token ids (image placeholders
already expanded) plus the pixel inputs recomputed from the episode's image bytes by the
model's own image processor (``vision_inputs.pixel_inputs``, as the rollout did)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from opentinker.services.modeling.vision_inputs import ImageInput, model_image_inputs


def vision_hidden_states(
    model: Any,
    image_processor: Any,
    tokens_B_L: torch.Tensor,
    attention_B_L: torch.Tensor,
    images: Sequence[ImageInput],
) -> torch.Tensor:
    """The final hidden states ``[B, L, H]`` of a vision-language model (Qwen2-VL: its
    ``model``, vision tower and language model) for rows holding images, what its head reads."""
    if image_processor is None:
        raise ValueError("the batch holds images but the policy is text-only (no image processor)")
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    extra = model_image_inputs(inner, image_processor, tokens_B_L, images)
    out = inner.model(input_ids=tokens_B_L, attention_mask=attention_B_L, use_cache=False, **extra)
    return out.last_hidden_state


def vision_token_logprobs(
    model: Any,
    image_processor: Any,
    token_ids: Sequence[int],
    images: Sequence[ImageInput],
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of every token after the first under the model (T-1 values, differentiable):
    log_softmax(logits / temperature) at position t, taken at token t+1."""
    device = next(model.parameters()).device
    ids_1_T = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    extra = model_image_inputs(model, image_processor, ids_1_T, images)
    logits_T_V = model(input_ids=ids_1_T, attention_mask=torch.ones_like(ids_1_T), **extra)
    logits_T_V = logits_T_V.logits[0, :-1].float()
    logprobs_T_V = torch.log_softmax(logits_T_V / temperature, dim=-1)
    return logprobs_T_V.gather(-1, ids_1_T[0, 1:].unsqueeze(-1)).squeeze(-1)
