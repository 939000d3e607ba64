"""The limits on images in env observations (environment.proto, ImagePart): how many per
reply, how large each (bytes and pixels), which MIME types, and that each is an image of its
type that can be read. EnvHub checks every Reset/Step reply against them, so a broken image
fails its episode by name here instead of failing the rollout that would decode it."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

from opentinker.envhub.v1 import environment_pb2

IMAGE_MIME_TYPES = frozenset({"image/png", "image/jpeg", "image/webp"})
DEFAULT_MAX_OBSERVATION_IMAGES = 4
DEFAULT_MAX_IMAGE_BYTES = 1 << 20  # 1 MiB
# Width x height: a small file can decode to a huge bitmap (a "decompression bomb").
MAX_IMAGE_PIXELS = 4096 * 4096
_MIME_OF_FORMAT = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


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
        if problem := _unreadable(image):
            return f"image {index} {problem}"
    return None


def _unreadable(image: environment_pb2.ImagePart) -> str | None:
    """Why the bytes are not a readable image of their MIME type (headers and chunks checked
    without decoding the pixels), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(image.data)) as picture:
                kind, (width, height) = picture.format, picture.size
                picture.verify()
    except Exception as err:  # PIL raises many kinds for bad data
        return f"is not a readable {image.mime_type} ({type(err).__name__}: {err})"
    if _MIME_OF_FORMAT.get(kind or "") != image.mime_type:
        return f"is {kind} data labelled {image.mime_type!r}"
    if width * height > MAX_IMAGE_PIXELS:
        return f"is {width}x{height} pixels, more than {MAX_IMAGE_PIXELS}"
    return None


DEFAULT_IMAGE_LIMITS = ImageLimits()
