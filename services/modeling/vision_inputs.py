"""Image inputs of a vision-language model, the same on the rollout and the trainer side.

An episode keeps its images as encoded bytes (``ImageInput``, the env's ImagePart) beside its
token ids; both sides turn them into the model's inputs with this one function and the model's
own image processor, so the trainer's forward sees exactly the pixels the rollout sampled with.
The token ids already hold every image's placeholder tokens, expanded (``expand_image_pads``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText

IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True)
class ImageInput:
    """One image of an episode: the encoded file and its MIME type."""

    data: bytes
    mime_type: str = "image/png"


def load_image_processor(model_dir: str | Path) -> Any:
    """The model folder's image processor (``preprocessor_config.json``), or None for a
    text-only model."""
    if not (Path(model_dir) / "preprocessor_config.json").exists():
        return None
    return AutoImageProcessor.from_pretrained(str(model_dir))


def load_language_model(model_dir: str | Path, *, dtype: torch.dtype) -> Any:
    """A causal LM, or a vision-language one (image-text-to-text) for a folder with an
    image processor: both generate text and give logits for ``input_ids``."""
    if load_image_processor(model_dir) is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype)


def pixel_inputs(image_processor: Any, images: Sequence[ImageInput]) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of the images, in order ({} for none)."""
    if not images:
        return {}
    pictures = [Image.open(io.BytesIO(image.data)).convert("RGB") for image in images]
    encoded = image_processor(images=pictures, return_tensors="pt")
    return {
        "pixel_values": encoded["pixel_values"],
        "image_grid_thw": encoded["image_grid_thw"],
    }


def model_image_inputs(
    model: Any, image_processor: Any, ids_1_T: torch.Tensor, images: Sequence[ImageInput]
) -> dict[str, torch.Tensor]:
    """The image keywords of a forward/generate over ``ids_1_T`` (on the model's device):
    ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (1 on image placeholder
    tokens, 0 elsewhere: what M-RoPE positions are computed from); {} without images."""
    if not images:
        return {}
    inputs = pixel_inputs(image_processor, images)
    inputs["mm_token_type_ids"] = (ids_1_T == model.config.image_token_id).long()
    return {key: value.to(ids_1_T.device) for key, value in inputs.items()}


def image_token_counts(image_processor: Any, grid_thw: torch.Tensor) -> list[int]:
    """Placeholder tokens per image: its patches over the merge window (Qwen2-VL)."""
    merge = int(image_processor.merge_size) ** 2
    return [int(row.prod()) // merge for row in grid_thw]


def expand_image_pads(ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> list[int]:
    """Each single image pad token in ``ids`` repeated as many times as its image needs."""
    out: list[int] = []
    remaining = list(counts)
    for token in ids:
        if token == pad_id:
            if not remaining:
                raise ValueError("the text has more image placeholders than there are images")
            out.extend([pad_id] * remaining.pop(0))
        else:
            out.append(token)
    if remaining:
        raise ValueError(f"{len(remaining)} images have no placeholder in the text")
    return out
