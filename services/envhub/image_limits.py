"""The limits on images in env observations (environment.proto, ImagePart): how many per
reply, how large each, which MIME types. EnvHub checks every Reset/Step reply against them."""

from __future__ import annotations

from dataclasses import dataclass

from opentinker.envhub.v1 import environment_pb2

IMAGE_MIME_TYPES = frozenset({"image/png", "image/jpeg", "image/webp"})
DEFAULT_MAX_OBSERVATION_IMAGES = 4
DEFAULT_MAX_IMAGE_BYTES = 1 << 20  # 1 MiB


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = DEFAULT_MAX_OBSERVATION_IMAGES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES


def image_problem(images: list[environment_pb2.ImagePart], limits: ImageLimits) -> str | None:
    """What is wrong with an observation's images (a sentence), or None when they are fine."""
    if len(images) > limits.max_images:
        return f"{len(images)} images, more than max_observation_images ({limits.max_images})"
    for index, image in enumerate(images):
        if image.mime_type not in IMAGE_MIME_TYPES:
            allowed = ", ".join(sorted(IMAGE_MIME_TYPES))
            return f"image {index} has mime_type {image.mime_type!r}, not one of {allowed}"
        if not image.data:
            return f"image {index} is empty (0 bytes)"
        if len(image.data) > limits.max_image_bytes:
            return (
                f"image {index} of {len(image.data)} bytes, more than max_image_bytes "
                f"({limits.max_image_bytes})"
            )
    return None


DEFAULT_IMAGE_LIMITS = ImageLimits()
