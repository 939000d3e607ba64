"""Geometry problems drawn with PIL: a shape with its lengths written on the figure, a question
about it, and the exact answer (an integer). The same seed gives the same figure and question.

Kinds: a rectangle (area or perimeter), a square (area or perimeter), a right triangle (area, or
the hypotenuse of a Pythagorean triple). The figure's PNG is small (``size`` pixels square,
112 by default: 16 image tokens for a Qwen2-VL processor).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

PYTHAGOREAN_TRIPLES = ((3, 4, 5), (5, 12, 13), (6, 8, 10), (8, 15, 17), (9, 12, 15))
KINDS = ("rectangle", "square", "right_triangle")


@dataclass(frozen=True)
class GeometryProblem:
    """A drawn figure (PNG bytes), the question about it, and its answer."""

    kind: str
    question: str
    answer: int
    png: bytes


def geometry_problem(seed: int, *, size: int = 112) -> GeometryProblem:
    """The problem a seed picks."""
    rng = random.Random(seed)
    kind = rng.choice(KINDS)
    canvas = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(canvas)
    margin = size // 6
    if kind == "right_triangle":
        a, b, c = rng.choice(PYTHAGOREAN_TRIPLES)
        left, bottom, right, top = margin, size - margin, size - margin, margin
        draw.polygon([(left, bottom), (right, bottom), (left, top)], outline="black", width=2)
        draw.text(((left + right) // 2, bottom + 2), str(b), fill="blue")
        draw.text((2, (top + bottom) // 2), str(a), fill="blue")
        if rng.random() < 0.5:
            question, answer = "What is the length of the hypotenuse?", c
        else:
            question, answer = "What is the area of the right triangle?", a * b // 2
    else:
        width = rng.randint(2, 12)
        height = width if kind == "square" else rng.randint(2, 12)
        draw.rectangle([margin, margin, size - margin, size - margin], outline="black", width=2)
        draw.text((size // 2 - 4, size - margin + 2), str(width), fill="blue")
        if kind == "rectangle":
            draw.text((2, size // 2 - 4), str(height), fill="blue")
        if rng.random() < 0.5:
            question, answer = f"What is the area of the {kind}?", width * height
        else:
            question, answer = f"What is the perimeter of the {kind}?", 2 * (width + height)
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return GeometryProblem(kind=kind, question=question, answer=answer, png=buffer.getvalue())
