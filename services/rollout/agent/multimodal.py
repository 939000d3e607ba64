"""Vision-language episodes in the rollout: chat templating with image parts, and generation
with the images' pixels.

A user turn with images renders through the model's chat template as content parts (every
image, then the text: ``[{"type": "image"}, ..., {"type": "text", "text": ...}]``), then each
image's single placeholder is expanded to the tokens its picture takes (the image processor's
grid, ``vision_inputs``). The episode keeps the token ids with the images' bytes; the engine
(``generate_with_images``) and the trainer recompute the same pixel inputs from those bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from opentinker.services.modeling.vision_inputs import (
    IMAGE_PAD,
    ImageInput,
    expand_image_pads,
    image_token_counts,
    model_image_inputs,
    pixel_inputs,
)
from opentinker.services.rollout.agent.chat_format import ChatFormat, template_tools
from opentinker.services.rollout.types import Completion, ResetResult, StepOutcome, ToolSpec
from opentinker.spec import SamplingParams


def vision_chat_for(engine: Any, tools: Sequence[ToolSpec]) -> VisionChat | None:
    """The engine's vision chat format, or None for a text-only model."""
    image_processor = getattr(engine, "image_processor", None)
    if image_processor is None:
        return None
    return VisionChat(engine.tokenizer, image_processor, template_tools(tools))


def prompt_ids_with_images(
    chat: ChatFormat, vision: VisionChat | None, system_prompt: str, reset: ResetResult
) -> list[int]:
    """An episode's first prompt: through the vision format when the model has one (with the
    reset's images), else the text chat format; ValueError for images a model cannot see."""
    if vision is None:
        refuse_images(reset.images)
        return chat.prompt_ids(system_prompt, reset.observation)
    return vision.prompt_ids(system_prompt, reset.observation, reset.images)


def observation_ids_with_images(
    chat: ChatFormat, vision: VisionChat | None, outcome: StepOutcome
) -> list[int]:
    """The ids of an observation turn (after the assistant's eos), with its images."""
    if vision is None:
        refuse_images(outcome.images)
        return chat.observation_ids(outcome.observation)
    return vision.observation_ids(outcome.observation, outcome.images)


def refuse_images(images: Sequence[ImageInput]) -> None:
    if images:
        raise ValueError(
            f"the env sent {len(images)} images but the model is text-only (its folder has no "
            "image processor, preprocessor_config.json); use a vision-language model"
        )


def images_of(parts: Sequence[Any]) -> tuple[ImageInput, ...]:
    """The protocol's ImageParts (environment.proto) as the rollout's images."""
    return tuple(ImageInput(part.data, part.mime_type) for part in parts)


def user_content(text: str, image_count: int) -> str | list[dict[str, str]]:
    """A user message's content: plain text, or its images' parts then its text."""
    if image_count == 0:
        return text
    return [*({"type": "image"} for _ in range(image_count)), {"type": "text", "text": text}]


class VisionChat:
    """Prompt and observation-turn ids of a vision-language model (its tokenizer's chat
    template and its image processor)."""

    def __init__(self, tokenizer: Any, image_processor: Any, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.pad_id: int = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self._tools = tools or None

    def _expanded(self, ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        if not images:
            return list(ids)
        grid = pixel_inputs(self.image_processor, images)["image_grid_thw"]
        return expand_image_pads(ids, self.pad_id, image_token_counts(self.image_processor, grid))

    def _render(self, messages: list[dict[str, Any]], *, tools: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=self._tools if tools else None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return list(ids)

    def prompt_ids(
        self, system_prompt: str, observation: str, images: Sequence[ImageInput]
    ) -> list[int]:
        """The first prompt: system (if any), the user turn with its images, the header."""
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": user_content(observation, len(images))}
        ]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return self._expanded(self._render(messages, tools=True), images)

    def observation_ids(self, observation: str, images: Sequence[ImageInput]) -> list[int]:
        """Ids after an assistant turn's eos: the turn's end, a user turn with its images, a
        new assistant header (the template's rendering of that turn, as ``ChatFormat``)."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        closed = list(
            self.tokenizer.apply_chat_template(
                probe, add_generation_prompt=False, tokenize=True, return_dict=False
            )
        )
        turn = {"role": "user", "content": user_content(observation, len(images))}
        full = self._render([*probe, turn], tools=False)
        if full[: len(closed)] != closed:
            raise ValueError("the chat template renders earlier turns differently later")
        last_eos = len(closed) - 1 - closed[::-1].index(self.tokenizer.eos_token_id)
        tail = [*closed[last_eos + 1 :], *full[len(closed) :]]
        return self._expanded(tail, images)


def generate_each_with_images(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    images: Sequence[Sequence[ImageInput]],
    sampling: SamplingParams,
    seed: int,
    decoding: dict[str, Any],
) -> list[Completion]:
    """A ``TransformersEngine``'s turns for prompts holding images, one prompt at a time
    (each with its own pixels), deterministic per seed; ``decoding``: generate()'s sampling
    options (the engine's)."""
    if engine.image_processor is None:
        raise ValueError("the model is text-only (no image processor); it cannot see images")
    devices = [engine.device] if engine.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return [
            generate_with_images(
                engine.model,
                engine.image_processor,
                prompt,
                prompt_images,
                sampling,
                eos_token_id=engine.eos_token_id,
                pad_token_id=engine.pad_token_id,
                decoding=decoding,
            )
            for prompt, prompt_images in zip(prompts, images, strict=True)
        ]


def vision_token_ids(config: Any) -> list[int]:
    """The ids of the vision markup tokens (image/video placeholders, vision start/end)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [getattr(config, name) for name in names if getattr(config, name, None) is not None]


@torch.no_grad()
def generate_with_images(
    model: Any,
    image_processor: Any,
    prompt: Sequence[int],
    images: Sequence[ImageInput],
    sampling: SamplingParams,
    *,
    eos_token_id: int,
    pad_token_id: int,
    decoding: dict[str, Any],
) -> Completion:
    """Sample one turn from a prompt holding images; its tokens and their sampling logprobs
    (temperature-scaled log-softmax, as ``TransformersEngine``). ``decoding``: generate()'s
    sampling options; without ``do_sample`` (greedy) the logprobs are at temperature 1."""
    device = next(model.parameters()).device
    ids_1_T = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    extra = model_image_inputs(model, image_processor, ids_1_T, images)
    result = model.generate(
        input_ids=ids_1_T,
        attention_mask=torch.ones_like(ids_1_T),
        **extra,
        **decoding,
        # Never sampled: a generated image placeholder would stand for no image (the forward
        # then fails: more image tokens than image features). The logprobs stay the raw ones.
        suppress_tokens=vision_token_ids(model.config),
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new_N = result.sequences[0, ids_1_T.shape[1] :].cpu()
    logits_N_V = torch.stack(result.logits, dim=1)[0].float().cpu()
    temperature = sampling.temperature if decoding.get("do_sample") else 1.0
    logprobs_N_V = torch.log_softmax(logits_N_V / temperature, dim=-1)
    sampled_N = logprobs_N_V.gather(-1, new_N.unsqueeze(-1)).squeeze(-1)
    ids = new_N.tolist()
    length = ids.index(eos_token_id) + 1 if eos_token_id in ids else len(ids)
    return Completion(token_ids=ids[:length], logprobs=sampled_N[:length].tolist())
