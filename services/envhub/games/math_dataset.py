"""A small math dataset generated here, never downloaded: for tests, the demo and the
built-in ``math`` environment's default data.

Six kinds of problems with exact answers written the way datasets write them (LaTeX fractions,
decimals, percentages, quantities with units), so that grading must compare values, not text.
The same ``seed`` always gives the same rows.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from opentinker.data import (
    GROUND_TRUTH,
    PROMPT,
    SPLIT,
    TRAIN,
    VALIDATION,
    Dataset,
    write_jsonl,
    write_parquet,
)

DEFAULT_COUNT = 200
DEFAULT_VALIDATION_FRACTION = 0.2


def _latex(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _fraction_sum(rng: random.Random) -> tuple[str, str]:
    (p, q), (r, s) = ((rng.randint(1, 9), rng.randint(2, 9)) for _ in range(2))
    return f"Compute ${p}/{q} + {r}/{s}$.", _latex(Fraction(p, q) + Fraction(r, s))


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(11, 99), rng.randint(2, 19), rng.randint(1, 200)
    return f"What is ${a} \\times {b} - {c}$?", str(a * b - c)


def _percentage(rng: random.Random) -> tuple[str, str]:
    percent, base = rng.choice([5, 10, 15, 20, 25, 40, 75]), rng.randint(1, 40) * 20
    return f"What is {percent}% of {base}?", _latex(Fraction(percent * base, 100))


def _distance(rng: random.Random) -> tuple[str, str]:
    speed, half_hours = rng.randint(20, 90), rng.randint(1, 8)
    hours = Fraction(half_hours, 2)
    shown = f"{float(hours):g}"
    return (
        f"A car drives at {speed} km/h for {shown} hours. How far does it go?",
        f"{float(speed * hours):g} \\text{{ km}}",
    )


def _linear_equation(rng: random.Random) -> tuple[str, str]:
    x, a, b = rng.randint(-12, 12), rng.randint(2, 9), rng.randint(-20, 20)
    sign = "+" if b >= 0 else "-"
    return f"Solve for $x$: ${a}x {sign} {abs(b)} = {a * x + b}$.", str(x)


def _decimal(rng: random.Random) -> tuple[str, str]:
    numerator, denominator = rng.randint(1, 15), rng.choice([2, 4, 5, 8, 16, 20, 25])
    value = Fraction(numerator, denominator)
    return f"Write ${numerator}/{denominator}$ as a decimal.", f"{float(value):g}"


PROBLEM_KINDS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "fraction_sum": _fraction_sum,
    "arithmetic": _arithmetic,
    "percentage": _percentage,
    "distance": _distance,
    "linear_equation": _linear_equation,
    "decimal": _decimal,
}


def generate_math_records(
    count: int = DEFAULT_COUNT,
    *,
    seed: int = 0,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
) -> list[dict[str, Any]]:
    """``count`` rows with ``prompt``, ``ground_truth``, ``split`` and the extra field ``kind``.

    Kinds take turns, so every kind appears in any 6 consecutive rows; about
    ``validation_fraction`` of the rows are ``validation``, chosen by the seed.
    """
    rng = random.Random(seed)
    kinds = list(PROBLEM_KINDS)
    records = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        prompt, answer = PROBLEM_KINDS[kind](rng)
        split = VALIDATION if rng.random() < validation_fraction else TRAIN
        records.append({PROMPT: prompt, GROUND_TRUTH: answer, SPLIT: split, "kind": kind})
    return records


def write_math_dataset(path: str | Path, *, count: int = DEFAULT_COUNT, seed: int = 0) -> Path:
    """Write the generated dataset as ``.parquet`` or ``.jsonl`` (by the path's suffix)."""
    records = generate_math_records(count, seed=seed)
    if Path(path).suffix.lower() == ".parquet":
        return write_parquet(records, path)
    return write_jsonl(records, path)


@functools.cache
def default_math_dataset() -> Dataset:
    """The generated dataset (``DEFAULT_COUNT`` rows, seed 0), built once per process."""
    return Dataset.from_records(generate_math_records(), source="<generated math, seed 0>")
